"""Print the "Scaling" tables of docs/gpus.md: gradient bytes per step, memory per preset, and an 8xH100
throughput estimate. Paper arithmetic from parameter counts -- nothing here is measured.

    PYTHONPATH=src python docs/scaling_numbers.py
"""

from gptspeed.config import PRESETS
from gptspeed.model import GPT

GIB = 2**30
B, T = 16, 1024  # activations at this micro-batch
N_GPU = 8
BUSBW = 350e9  # B/s: NCCL all-reduce bus bandwidth one may expect on 8xH100 SXM NVLink (assumed)
IB_BUSBW = 45e9  # B/s: across nodes with 400 Gb/s InfiniBand per GPU (assumed)
PEAK, MFU = 989e12, 0.40  # H100 SXM dense bf16 peak; assumed single-GPU MFU


def main() -> None:
    rows = []
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        cfg = PRESETS[name]
        m = cfg.model
        import torch

        with torch.device("meta"):
            model = GPT(m)
        n = model.num_params(False)
        L, H, C = m.n_layer, m.n_head, m.n_embd
        act_layer = 34 * B * T * C + 5 * B * H * T * T  # bytes, 16-bit, no flash attention (Korthikanti et al. 2022)
        rows.append((name, cfg, n, L, H, C, act_layer, model.flops_per_token(T)))
    ring = 2 * (N_GPU - 1) / N_GPU
    print(
        f"| preset | params | grads bf16 | grads fp32 | sent+received per GPU per step, fp32 (bf16) | "
        f"all-reduce at {BUSBW / 1e9:.0f} GB/s, fp32 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, _cfg, n, *_ in rows:
        print(
            f"| {name} | {n / 1e6:.0f}M | {2 * n / GIB:.2f} GiB | {4 * n / GIB:.2f} GiB | "
            f"{ring * 4 * n / GIB:.2f} ({ring * 2 * n / GIB:.2f}) GiB | {1e3 * ring * 4 * n / BUSBW:.1f} ms |"
        )
    print()
    print(
        "| preset | weights fp32 | grads fp32 | AdamW m+v | activations B=16 T=1024 (flash: without 5BHT²) "
        "| DDP total | FSDP, 8 GPUs (weights+grads+AdamW /8 + activations) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, _cfg, n, L, _H, C, act, _ in rows:
        act_all, act_flash = L * act / GIB, L * 34 * B * T * C / GIB
        states = 16 * n / GIB
        print(
            f"| {name} | {4 * n / GIB:.1f} GiB | {4 * n / GIB:.1f} GiB | {8 * n / GIB:.1f} GiB | "
            f"{act_all:.1f} GiB ({act_flash:.1f}) | {states + act_flash:.1f} GiB | {states / N_GPU + act_flash:.1f} GiB |"
        )
    print()
    print(
        "| preset | 1 GPU tok/s (MFU 40%) | 8 GPUs compute-bound | all-reduce fp32 | exposed after overlap | "
        "8xH100 estimate | 2 nodes x 8 (IB) estimate |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, cfg, n, _L, _H, _C, _act, fpt in rows:
        r1 = MFU * PEAK / fpt
        tokens = cfg.train.total_batch_tokens
        compute = tokens / (N_GPU * r1)
        accum = max(1, tokens // (cfg.train.batch_size * T * N_GPU))
        window = (2 / 3) * compute / accum  # backward of the last micro-step: what DDP can overlap
        comm = ring * 4 * n / BUSBW
        exposed = max(0.0, comm - window)
        comm16 = ring * 4 * n / IB_BUSBW
        compute16 = compute / 2
        window16 = (2 / 3) * compute16 / max(1, accum // 2)
        e16 = max(0.0, comm16 - window16)
        print(
            f"| {name} | {r1 / 1e3:.0f}k | {N_GPU * r1 / 1e6:.2f}M | {1e3 * comm:.1f} ms | {1e3 * exposed:.1f} ms | "
            f"{tokens / (compute + exposed) / 1e6:.2f}M tok/s | {tokens / (compute16 + e16) / 1e6:.2f}M tok/s |"
        )


if __name__ == "__main__":
    main()
