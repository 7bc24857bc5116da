"""Prototype (scratch, not in the repo): the fused loss's per-chunk softmax work, as loss.py does it
vs with fewer passes over the (n, V) chunk. One thread, interleaved, median of rounds."""
import statistics, sys, time, torch
torch.set_num_threads(1)
V, Vv = 50304, 50257
def current(xc, w, tc, N, grad_w, grad_x_out):
    logits = xc @ w.t()
    logits[:, Vv:] = float("-inf")
    target_logit = logits.gather(1, tc.unsqueeze(1)).squeeze(1)
    m = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(m).exp_()
    s = probs.sum(dim=1, keepdim=True)
    loss = (m.squeeze(1) + s.log().squeeze(1) - target_logit).sum()
    probs.mul_((s * N).reciprocal_())
    probs[torch.arange(tc.numel()), tc] -= 1.0 / N
    grad_x_out.copy_(probs @ w)
    grad_w.addmm_(probs.t(), xc)
    return loss
def proposed(xc, w, tc, N, grad_w, grad_x_out):
    logits = xc @ w.t()
    logits[:, Vv:] = float("-inf")
    target_logit = logits.gather(1, tc.unsqueeze(1)).squeeze(1)
    lse = torch.logsumexp(logits, dim=1, keepdim=True)   # max + sum(exp) in one op
    probs = logits.sub_(lse).exp_()                      # softmax, already normalised
    loss = (lse.squeeze(1) - target_logit).sum()
    probs[torch.arange(tc.numel()), tc] -= 1.0
    torch.mm(probs, w, out=grad_x_out); grad_x_out.mul_(1.0 / N)   # 1/N on (n, C), not (n, V)
    grad_w.addmm_(probs.t(), xc, alpha=1.0 / N)
    return loss / 1.0
for C in (128, 768):
    n = (1 << 22) // V
    N = 2048
    torch.manual_seed(0)
    xc, w = torch.randn(n, C), torch.randn(V, C) * 0.02
    tc = torch.randint(0, Vv, (n,))
    gw1, gw2 = torch.zeros(V, C), torch.zeros(V, C)
    gx1, gx2 = torch.empty(n, C), torch.empty(n, C)
    l1 = current(xc, w, tc, N, gw1, gx1); l2 = proposed(xc, w, tc, N, gw2, gx2)
    print(f"C={C}: loss diff {abs(l1-l2).item():.2e}, grad_w max diff {(gw1-gw2).abs().max().item():.2e}, grad_x {(gx1-gx2).abs().max().item():.2e}")
    t = {"current": [], "proposed": []}
    for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 15):
        for name, f, gw, gx in (("current", current, gw1, gx1), ("proposed", proposed, gw2, gx2)):
            t0 = time.perf_counter(); f(xc, w, tc, N, gw, gx); t[name].append(1000 * (time.perf_counter() - t0))
    ratios = [a / b for a, b in zip(t["current"], t["proposed"])]
    print(f"C={C} chunk of {n} rows: current {statistics.median(t['current']):.2f} ms, proposed {statistics.median(t['proposed']):.2f} ms, "
          f"median per-round ratio {statistics.median(ratios):.3f} (min {min(ratios):.3f} max {max(ratios):.3f})")
