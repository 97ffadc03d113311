"""The GRPO loss written token by token from the formulas in docs/loss.md.

Deliberately naive -- Python loops over samples and tokens, scalar tensors, no masking
tricks -- and written from the formulas, not from ``workers.loss``: the tests compare
the vectorised loss's value and gradient with this one. GSPO is the paper's GSPO-token
form, s_t = sg(s_b) * pi(y_t) / sg(pi(y_t)); with ``gspo_sequence=True`` it is the
sequence form instead (one ratio s_b, a differentiable function of the whole sequence),
which has the same gradient when advantages and weights are constant within a sequence.
"""

from __future__ import annotations

import math

import torch

from workers.loss import LossOptions


def _clamp(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.clamp(x, lo, hi)


def _kl(d: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(d) - d - 1


def _weights(ls: list[torch.Tensor], ok: list[bool], cfg: LossOptions) -> list[torch.Tensor]:
    """Importance weights of one sequence's valid tokens (l_t = old_t - g_t)."""
    a, b, kind = cfg.is_min, cfg.is_cap, cfg.is_correction.value
    one = torch.ones((), dtype=torch.float64)
    if kind == "none":
        w = [one for _ in ls]
    elif kind == "tis":
        w = [_clamp(torch.exp(l), a, b) for l in ls]
    elif kind == "icepop":
        w = [torch.exp(l) if a <= float(torch.exp(l)) <= b else 0 * one for l in ls]
    elif kind == "seq-tis":
        s = _clamp(torch.exp(sum(ls)), a, b)
        w = [s for _ in ls]
    else:  # seq-mask-tis
        keep = a <= math.exp(float(sum(ls)) / len(ls)) <= b
        w = [torch.exp(l) if keep else 0 * one for l in ls]
    return [wi.detach() if o else 0 * one for wi, o in zip(w, ok)]


def _surrogate(lps, olds, advs, cfg: LossOptions, sequence_form: bool) -> list[torch.Tensor]:
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    kind = cfg.policy_loss.value
    out = []
    if kind == "gspo" and sequence_form:
        s = torch.exp(sum(lp - o for lp, o in zip(lps, olds)) / len(lps))
        ratios = [s for _ in lps]
    elif kind == "gspo":
        s = math.exp(float(sum(lp.detach() - o for lp, o in zip(lps, olds))) / len(lps))
        ratios = [s * torch.exp(lp - lp.detach()) for lp in lps]
    else:
        ratios = [torch.exp(lp - o) for lp, o in zip(lps, olds)]
    for r, lp, a in zip(ratios, lps, advs):
        if kind == "cispo":
            out.append(-_clamp(r, lo, hi).detach() * a * lp)
            continue
        pg = torch.maximum(-r * a, -_clamp(r, lo, hi) * a)
        if cfg.dual_clip and a < 0:
            pg = torch.minimum(pg, -cfg.dual_clip * a)
        out.append(pg)
    return out


def _kl_term(lp, old, ref, cfg: LossOptions) -> torch.Tensor:
    d = ref - lp
    clamped = False
    if cfg.kl_input_clamp and abs(float(d.detach())) > cfg.kl_input_clamp:
        d, clamped = _clamp(d, -cfg.kl_input_clamp, cfg.kl_input_clamp), True
    k = _kl(d, cfg.kl_estimator.value)
    if cfg.kl_gradient.value == "score":
        v = torch.exp(lp - old)
        k = (v.detach() if clamped else v) * k
    if cfg.kl_output_clamp:
        k = _clamp(k, -cfg.kl_output_clamp, cfg.kl_output_clamp)
    return k


def reference_loss(
    lp: torch.Tensor, batch, cfg: LossOptions, *, ref=None, old=None, entropy=None,
    gspo_sequence: bool = False,
) -> torch.Tensor:
    """The step's loss L (already divided by its normaliser) of one batch."""
    mask, gen = batch.loss_mask, batch.generator_logprobs.double()
    per_token_adv = batch.advantages.dim() == 2
    beta = cfg.kl_coef
    seq_terms, n_tokens, n_seqs = [], 0, 0
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not ts:
            continue
        n_seqs += 1
        n_tokens += len(ts)
        ok = [math.isfinite(float(gen[b, t])) for t in ts]
        lps = [lp[b, t] for t in ts]
        if old is not None:
            olds = [old[b, t].double() if o else lp[b, t].detach() for t, o in zip(ts, ok)]
        elif cfg.old_policy.value == "generator":
            olds = [gen[b, t] if o else lp[b, t].detach() for t, o in zip(ts, ok)]
        else:
            olds = [lp[b, t].detach() for t in ts]
        ls = [(o - gen[b, t]) if k else 0 * o for o, t, k in zip(olds, ts, ok)]
        advs = [batch.advantages[b, t] if per_token_adv else batch.advantages[b] for t in ts]
        advs = [a.double() for a in advs]
        if beta > 0 and cfg.kl_placement.value == "reward":
            rcfg = LossOptions(**{**_fields(cfg), "kl_gradient": "direct"})
            advs = [
                a - beta * _kl_term(o.detach(), o.detach(), ref[b, t].double(), rcfg).detach()
                for a, o, t in zip(advs, olds, ts)
            ]
        ws = _weights(ls, ok, cfg)
        pgs = _surrogate(lps, olds, advs, cfg, gspo_sequence)
        terms = [w * pg for w, pg in zip(ws, pgs)]
        if beta > 0 and cfg.kl_placement.value == "loss":
            terms = [
                x + beta * _kl_term(l, o, ref[b, t].double(), cfg)
                for x, l, o, t in zip(terms, lps, olds, ts)
            ]
        if cfg.entropy_coef:
            terms = [x - cfg.entropy_coef * entropy[b, t] for x, t in zip(terms, ts)]
        seq_terms.append(terms)
    agg = cfg.aggregation.value
    if agg == "token":
        return sum(sum(ts) for ts in seq_terms) / n_tokens
    if agg == "sequence":
        return sum(sum(ts) / len(ts) for ts in seq_terms) / n_seqs
    if agg == "seq-mean-token-sum":
        return sum(sum(ts) for ts in seq_terms) / n_seqs
    return sum(sum(ts) / cfg.norm_length for ts in seq_terms) / n_seqs


def _fields(cfg: LossOptions) -> dict:
    import msgspec

    return msgspec.structs.asdict(cfg)
