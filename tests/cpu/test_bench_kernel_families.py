"""Kernel families of the decode benchmark: CUPTI kernel names grouped by what they compute."""

from __future__ import annotations

import pytest

from graphtune.bench.cupti import DeviceEvent
from graphtune.bench.kernel_families import FAMILIES, family_of, kernel_families


@pytest.mark.parametrize(
    "name,family",
    [
        ("nvjet_tst_128x8_64x16_2x1_v_bz_splitK_TNT", "GEMV/GEMM"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "GEMV/GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "GEMV/GEMM"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16>", "GEMV/GEMM"),
        ("fused_gemv_kernel", "GEMV/GEMM"),
        ("gemm_kernel", "GEMV/GEMM"),
        ("splitk_reduce_kernel", "GEMV/GEMM"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x64x64_4x1x1_kernel0_0", "attention"),
        ("decode_attention_kernel", "attention"),
        ("decode_attention_combine_kernel", "attention"),
        ("rms_norm_kernel", "norms"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "norms"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms"),
        ("rope_kv_kernel", "RoPE"),
        ("triton_poi_fused_add_cat_mul_neg_slice_unsqueeze_1", "RoPE"),
        ("silu_and_mul_kernel", "activation"),
        ("triton_poi_fused_mul_silu_2", "activation"),
        ("allreduce_add_rms_norm_kernel", "communication"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
        (
            "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2>",
            "other",
        ),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>", "other"),
        ("Memset (Device)", "other"),
        # graphtune's mixture-of-experts Triton kernels (graphtune.ops.moe).
        ("moe_gate_up_kernel", "GEMV/GEMM"),
        ("moe_down_kernel", "GEMV/GEMM"),
        ("moe_gemv_gate_up_kernel", "GEMV/GEMM"),
        ("moe_gemv_down_kernel", "GEMV/GEMM"),
        ("moe_router_kernel", "routing"),
        ("moe_route_top_k_kernel", "routing"),
        ("moe_histogram_kernel", "routing"),
        ("moe_align_kernel", "routing"),
        ("moe_sum_kernel", "other"),
        ("decode_inputs_kernel", "other"),
        # torch's and vLLM-style routing kernels; a bare softmax does not say whose it is.
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "routing"),
        ("void moe::topkGatingSoftmax<4, 64, 4, 16, int>", "routing"),
        (
            "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
            "(anonymous namespace)::SoftMaxForwardEpilogue>",
            "other",
        ),
    ],
)
def test_family_of_known_kernel_names(name: str, family: str) -> None:
    assert family_of(name) == family


def test_kernel_families_sum_per_call_in_family_order() -> None:
    events = [
        DeviceEvent("fused_gemv_kernel", "kernel", 0.0, 6.0),
        DeviceEvent("decode_attention_kernel", "kernel", 7.0, 2.0),
        DeviceEvent("fused_gemv_kernel", "kernel", 10.0, 4.0),
        DeviceEvent("indexSelectLargeIndex", "kernel", 15.0, 1.0),
    ] * 2
    got = kernel_families(events, calls=2)
    assert list(got) == ["GEMV/GEMM", "attention", "other"]
    assert list(got) == [f for f in FAMILIES if f in got]
    assert got["GEMV/GEMM"] == {"us": 10.0, "calls": 2.0}
    assert got["attention"] == {"us": 2.0, "calls": 1.0}
    with pytest.raises(ValueError, match="calls"):
        kernel_families(events, calls=0)
