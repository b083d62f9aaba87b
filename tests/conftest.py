import os

# Progress bars off in tests; they write to stderr only on terminals anyway.
os.environ.setdefault("GRAPHTUNE_NO_PROGRESS", "1")
