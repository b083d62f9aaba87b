import os

# Progress bars off in tests; they write to stderr only on terminals anyway.
os.environ.setdefault("GRAPHTUNE_NO_PROGRESS", "1")


import pytest  # noqa: E402


@pytest.fixture
def unpruned(monkeypatch):
    """Lifts the limits of ``graphtune.ops._pruned``: every runner offers its tactics at every
    bucket, as before the limits (tests whose scenario needs a fused kernel at one or two rows).
    The one-kernel attention stays out of the op's runners."""
    from graphtune.ops import _pruned
    from graphtune.ops.gemm.gemv import MAX_M

    monkeypatch.setattr(_pruned, "GEMV_MAX_ROWS", MAX_M)
    monkeypatch.setattr(_pruned, "RMS_NORM_ONE_PASS_UP_TO", 0)
    monkeypatch.setattr(_pruned, "SILU_MAX_PER_THREAD", 16)
    for name in (
        "TILED_GEMM_MIN_ROWS",
        "ADD_PROJECTION_MIN_ROWS",
        "QKV_AFTER_NORM_MIN_ROWS",
        "NORM_LINEAR_IN_LOOP_MIN_ROWS",
    ):
        monkeypatch.setattr(_pruned, name, 1)
