"""GRPO loss: clipped policy gradient with off-policy corrections, KL and entropy terms.

Notation, per completion token t of sample b (only where ``loss_mask`` is True):

* ``lp``  = log pi_theta(y_t | y_<t), the trainer's logprob at temperature tau
  (logits / tau, the same scaling the generator sampled with);
* ``g``   = log mu(y_t | y_<t), the generator's logprob (``TrainBatch.generator_logprobs``);
  mu is the behaviour policy: possibly a few weight versions stale, and a different
  kernel/precision even when fresh;
* ``old`` = log pi_old(y_t | y_<t), the policy the ratio is taken against;
* ``ref`` = log pi_ref(y_t | y_<t), the frozen reference model;
* ``A``   = the token's advantage (``TrainBatch.advantages``: one value per sequence,
  GRPO-style, or any per-token values, e.g. per-turn rewards of a multi-turn episode).

What "old" means here (``old_policy``). The controller trains each batch with exactly one
optimizer step, so the policy at the start of that step *is* the current policy:
pi_old = sg(pi_theta) (``trainer``, the default). Then r = exp(lp - sg(lp)) equals 1 in
value, its gradient is grad(lp), and clipping is inert; staleness and the numeric
generator/trainer mismatch are corrected by the importance weight w below. With
``generator``, old = g: r = pi_theta / mu is clipped (classic PPO against the behaviour
policy) and w = 1 for ``tis``. Callers can also pass explicit ``old_logprobs``.

Importance weight (``is_correction``; detached; l_t = old_t - g_t, [a, b] = [is_min, is_cap]):

    tis           w_t = clamp(e^{l_t}, a, b)                        (default: a = 0, b = 2)
    icepop        w_t = e^{l_t} if a <= e^{l_t} <= b else 0
    seq-tis       w_t = clamp(e^{sum_t l_t}, a, b)                  (one weight per sequence)
    seq-mask-tis  w_t = e^{l_t} if a <= e^{mean_t l_t} <= b else 0  (whole sequences masked)
    none          w_t = 1

A token whose g is -inf or nan cannot be reweighted: w_t = 0, and it is counted in
``gen_logprob_invalid`` (it still counts in the normaliser).

Policy surrogate (``policy_loss``; eps_l, eps_h = ``clip_low``, ``clip_high``):

    ppo    r_t = e^{lp_t - old_t}
           pg_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_l, 1 + eps_h) A_t)
    gspo   s_b = e^{mean_t (lp_t - old_t)}, written per token as r_t = sg(s_b) e^{lp_t - sg(lp_t)}
           pg_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_l, 1 + eps_h) A_t)   (clipped per sequence)
    cispo  pg_t = -w_t * sg(clip(r_t, 1 - eps_l, 1 + eps_h)) A_t lp_t

Dual clip (``dual_clip`` = c > 1; ppo and gspo): for A_t < 0, pg_t = min(pg_t, -w_t c A_t).
Log-ratios are clamped at +-``LOG_RATIO_MAX`` before ``exp``: with explicit old logprobs
lp - old can exceed 88, where exp overflows float32 and the backward pass computes
0 * inf = nan even for a clipped token whose true gradient is 0; e^20 is far beyond any
clip bound, so clipped terms keep their value and carry no gradient past it.

KL penalty to the reference (``kl_coef`` = beta > 0), d_t = clamp(ref_t - lp_t, +-kl_input_clamp):

    k1 = -d,   k2 = d^2 / 2,   k3 = e^d - d - 1                   (``kl_estimator``)
    loss_t = pg_t + beta * clamp(v_t * k_t, +-kl_output_clamp)      (``kl_placement = loss``)

with v_t = 1 (``kl_gradient = direct``, verl) or v_t = e^{lp_t - old_t}, value 1 under
``old_policy = trainer`` (``score``, NeMo-RL; detached where the input clamp acts). The
two differ in the gradient they carry, in expectation over samples from pi_theta:

    direct: k1 -> 0,  k2 -> grad KL(pi_theta || pi_ref),  k3 -> grad KL(pi_ref || pi_theta)
    score:  k1, k3 -> grad KL(pi_theta || pi_ref),  k2 -> grad E[k2] (close to it)

(k3 is unbiased for KL(pi_theta || pi_ref) in *value* either way.) With
``kl_placement = reward`` the KL of the sampling policy is a per-token reward instead:
A_t <- A_t - beta * clamp(k(old_t, ref_t)), no gradient through it (NeMo-RL's
use_kl_in_reward, applied to the controller's group-normalised advantages).

Entropy (``entropy_coef`` = c_H): H_t = -sum_v pi_theta(v) log pi_theta(v) over the
vocabulary; reported every step as ``entropy``, and loss_t -= c_H * H_t when c_H > 0.

Aggregation (``aggregation``), each a sum divided by a global count or a constant, so a
step split into microbatches and data-parallel ranks equals the one-shot step:

* ``token``:                   L = sum_{b,t} loss_bt / N_tokens
* ``sequence``:                L = sum_b mean_t(loss_bt) / N_sequences
* ``seq-mean-token-sum``:      L = sum_b sum_t(loss_bt) / N_sequences
* ``seq-mean-token-sum-norm``: L = sum_b sum_t(loss_bt) / (N_sequences * norm_length)
  (Dr. GRPO: a constant length, the generation budget by default)

A sequence with no valid token is not counted. :func:`grpo_loss` returns the *raw sum*
-- the numerator with the normaliser set to 1 -- so the trainer divides once by the
global N (see ``workers.trainer``). Every metric comes back as a sum (or min/max) tagged
with the :class:`MetricKind` that says what it must later be divided by; the
train/inference mismatch metrics (``mismatch_kl`` = mean of e^d - d - 1 with
d = lp - g, an estimate of KL(mu || pi_theta); ``mismatch_logprob_diff_mean/max`` of |d|)
cover only the tokens generated at the trainer's own weight version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.lazy import lazy_exports

if TYPE_CHECKING:
    from workers.loss.config import (
        Aggregation,
        ISCorrection,
        KLEstimator,
        KLGradient,
        KLPlacement,
        LossOptions,
        OldPolicy,
        PolicyLoss,
        StepLoss,
    )
    from workers.loss.core import LossOutput, current_tokens, grpo_loss, microbatch_loss
    from workers.loss.logprobs import (
        LOG_RATIO_MAX,
        token_logprobs,
        token_logprobs_and_entropy,
        valid_counts,
    )
    from workers.loss.metrics import Metric, MetricKind, mismatch_warning

#: public name -> the module that defines it, imported on first use: the torch-free
#: ``config`` (composed into the run's ``Config``) must not pull in torch
_EXPORTS = {
    **dict.fromkeys(
        ("Aggregation", "ISCorrection", "KLEstimator", "KLGradient", "KLPlacement",
         "LossOptions", "OldPolicy", "PolicyLoss", "StepLoss"),
        "workers.loss.config",
    ),
    **dict.fromkeys(
        ("LossOutput", "current_tokens", "grpo_loss", "microbatch_loss"), "workers.loss.core"
    ),
    **dict.fromkeys(
        ("LOG_RATIO_MAX", "token_logprobs", "token_logprobs_and_entropy", "valid_counts"),
        "workers.loss.logprobs",
    ),
    **dict.fromkeys(("Metric", "MetricKind", "mismatch_warning"), "workers.loss.metrics"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
