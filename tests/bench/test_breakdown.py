"""``gptspeed.bench.breakdown``: where a profiled training step's time goes, summed by category: ``bench profile``'s breakdown."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gptspeed import cli
from gptspeed.bench import ladder as ladder_mod
from gptspeed.bench.breakdown import CATEGORIES, H100_ESTIMATE, RULES, attribute, breakdown_events, classify, markdown

from support.ladder_rows import in_process_worker
from support.shapes import LADDER_FLAGS

pytestmark = pytest.mark.usefixtures("one_thread")

ELLIPSIS = "(...)"


NAMES = {
    "matmul": [
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>"
        "(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
        "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)",
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>" + ELLIPSIS,
        "triton_tem_fused_addmm_0",
        "triton_tem_fused_mm_3",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::_scaled_mm",
    ],
    "attention": [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, "
        "false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, "
        "4, 2, 2, false, false, cutlass::bfloat16_t>, false, true, false, false, true, true, false>"
        "(pytorch_flash::Flash_bwd_params)",
        "void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 2, 2, false, "
        "false, cutlass::bfloat16_t> >(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "triton_tem_fused_flex_attention_0",
        "triton_tem_fused_flex_attention_backward_2",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "aten::_scaled_dot_product_cudnn_attention",
    ],
    "memory-bound": [
        "triton_poi_fused_add_gelu_mul_3",
        "triton_red_fused__to_copy_native_layer_norm_1",
        "triton_per_fused__log_softmax_2",
        "triton_poi_fused_0",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
        "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >"
        + ELLIPSIS,
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
        "unsigned int, float, 4, 4> >" + ELLIPSIS,
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>" + ELLIPSIS,
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 1u, 32u, "
        "true, false>" + ELLIPSIS,
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>" + ELLIPSIS,
        # gpu_kernel_impl_nocast and LoadWithCast contain "cast" but do not cast
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add"
        "<float> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<float> const&)::{lambda(int)#1}>" + ELLIPSIS,
        "void at::native::unrolled_elementwise_kernel<at::native::MulFunctor<float>, std::array<char*, 3ul>, "
        "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >" + ELLIPSIS,
        "_layer_norm_forward_kernel",
        "_cross_entropy_kernel",
        "aten::_log_softmax",
        "aten::fill_",
        "aten::native_layer_norm",
        "aten::add_",
    ],
    "copies/casts": [
        "Memcpy HtoD (Pageable -> Device)",
        "Memcpy DtoD (Device -> Device)",
        "Memset (Device)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda"
        "(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >"
        + ELLIPSIS,
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::"
        "operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>" + ELLIPSIS,
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)::"
        "OpaqueType<4u>, unsigned int, 1, 128, 1>" + ELLIPSIS,
        "triton_poi_fused__to_copy_0",
        "triton_poi_fused__to_copy_t_5",
        "triton_poi_fused_clone_view_2",
        "void transformer_engine::cast_transpose_kernel<8, true, float, __nv_bfloat16>" + ELLIPSIS,
        "aten::copy_",
        "aten::_to_copy",
        "aten::to",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, double*, double*>"
        + ELLIPSIS,
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous "
        "namespace)::NormType)1, float, float>, float*, int>" + ELLIPSIS,
        "void at::native::lpnorm_cleanup<float, (at::native::(anonymous namespace)::NormType)1, float, float>"
        + ELLIPSIS,
        "aten::_fused_adamw_",
        "aten::_foreach_norm",
        "aten::_foreach_mul_",
        "Optimizer.step#AdamW.step",
    ],
    "other": [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "Torch-Compiled Region: 0/0",
        "TorchDynamo Cache Lookup",
        "autograd::engine::evaluate_function: LogSoftmaxBackward0",
        "NativeLayerNormBackward0",
        "my_custom_kernel",
    ],
}


def _event(name, start, end, device="cuda", kind="kernel", annotation=False, children=()):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        activity_type=kind,
        device_type=getattr(torch.autograd.DeviceType, device.upper()),
        is_async=False,
        is_user_annotation=annotation,
        is_python_function=False,
        cpu_children=list(children),
    )


def _shares(bd):
    return {r["category"]: r["share"] for r in bd["categories"]}


@pytest.mark.parametrize("category, name", [(c, n) for c, names in NAMES.items() for n in names])
def test_each_kernel_or_op_name_lands_in_its_category(category, name):
    assert classify(name) == category


def test_every_rule_names_a_category_and_a_source():
    assert {r.category for r in RULES} <= set(CATEGORIES) - {"idle"}
    assert all(r.source for r in RULES)


def test_overlapping_intervals_count_once_split_among_them():
    per_name, busy = attribute([("a", 0, 4), ("b", 2, 6), ("a", 8, 9), ("c", 5, 5)])
    assert busy == 7  # [0, 6] and [8, 9]
    assert per_name == {"a": [4.0, 2], "b": [3.0, 1], "c": [0.0, 1]}  # [2, 4] split between a and b


def test_idle_is_the_wall_span_less_the_union_of_kernels_on_all_streams():
    events = [
        _event("aten::linear", 0, 2, device="cpu", kind="cpu_op"),  # the host starts the span
        _event("cudaDeviceSynchronize", 18, 20, device="cpu", kind="cuda_runtime"),  # ... and ends it
        _event("Optimizer.step#AdamW.step", 2, 12, annotation=True, kind="gpu_user_annotation"),  # spans kernels
        _event("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", 2, 6),  # stream 7
        _event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 4, 8),  # stream 8, overlaps
        _event("Memcpy HtoD (Pageable -> Device)", 10, 12, kind="gpu_memcpy"),
    ]
    bd = breakdown_events(events, steps=2, device="cuda:0")
    assert bd["basis"] == "device kernels" and bd["wall_ms_per_step"] == pytest.approx(20e-3 / 2)
    shares = _shares(bd)
    # busy [2, 8] + [10, 12] = 8 us of 20; [4, 6] is split between the matmul and the attention kernel
    assert shares == pytest.approx(
        {
            "matmul": 3 / 20,
            "attention": 3 / 20,
            "memory-bound": 0,
            "copies/casts": 2 / 20,
            "optimizer": 0,
            "other": 0,
            "idle": 12 / 20,
        }
    )
    assert sum(shares.values()) == pytest.approx(1)
    matmul = bd["categories"][0]
    assert matmul["kernels"] == 0.5 and matmul["top"] == [("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", 1.5e-3)]


def test_on_a_cpu_ops_count_their_self_time_and_idle_is_between_top_level_ops():
    addmm = _event("aten::addmm", 1, 8, device="cpu", kind="cpu_op")
    events = [
        _event("aten::linear", 0, 10, device="cpu", kind="cpu_op", children=[addmm]),
        addmm,
        _event("aten::add", 12, 14, device="cpu", kind="cpu_op"),
    ]
    bd = breakdown_events(events, steps=1, device="cpu")
    assert bd["basis"] == "cpu ops"
    assert _shares(bd) == pytest.approx(
        {
            "matmul": 10 / 14,
            "attention": 0,
            "memory-bound": 2 / 14,
            "copies/casts": 0,
            "optimizer": 0,
            "other": 0,
            "idle": 2 / 14,
        }
    )
    assert bd["categories"][0]["kernels"] == 2  # linear once (cut in two by addmm) and addmm


def test_the_table_carries_the_estimate_only_when_given_and_lists_the_unclassified():
    events = [_event("nvjet_tst_x", 0, 6), _event("my_custom_kernel", 6, 8), _event("triton_poi_fused_add_0", 9, 10)]
    plain = markdown(breakdown_events(events, steps=1, device="cuda:0"))
    assert "estimate" not in plain and "| **total** | 0.010 | 100.0% |" in plain
    assert "In `other`" in plain and "`my_custom_kernel` 0.002 ms" in plain
    table = markdown(breakdown_events(events, steps=1, device="cuda:0", estimate=H100_ESTIMATE))
    assert "| estimate (H100) |" in table and "36.3 ms" in table
    rows = {
        line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[-1]
        for line in table.splitlines()
        if line.startswith("| ")
    }
    assert rows["matmul"] == "52%" and rows["optimizer"] == "(in memory-bound)" and rows["other"] == "—"
    accumulated = breakdown_events(events, steps=1, device="cuda:0", micro_batches=4)
    assert accumulated["wall_ms_per_micro_batch"] == pytest.approx(0.0025)
    assert "0.010 ms a step of 4 micro-batches (0.003 ms each)" in markdown(accumulated)


def test_bench_profile_writes_the_breakdown(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ladder_mod, "run_worker", in_process_worker)
    assert cli.main(["bench", "profile", "fused-adamw", "--out", str(tmp_path), *LADDER_FLAGS]) == 0
    out = capsys.readouterr().out
    bd = json.loads((tmp_path / "profile-fused-adamw-breakdown.json").read_text())
    md = (tmp_path / "profile-fused-adamw-breakdown.md").read_text()
    assert (tmp_path / "trace-fused-adamw.json").exists() and (tmp_path / "profile-fused-adamw.txt").exists()
    assert bd["device"] == "cpu" and bd["basis"] == "cpu ops" and bd["steps"] == 2 and bd["micro_batches"] == 1
    assert bd["estimate"] is None
    assert [r["category"] for r in bd["categories"]] == list(CATEGORIES)
    shares = _shares(bd)
    assert shares["matmul"] > 0 and shares["attention"] > 0 and shares["optimizer"] > 0
    assert sum(shares.values()) == pytest.approx(1)
    assert md in out and "| **total** |" in md and "100.0%" in md
