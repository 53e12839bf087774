"""The `[algorithm]` section: the objective, its variants, and the corrections around it.

Kept apart from schema.py (which re-exports it) because it is the section that grows with every
paper: loss types and their parameters, the mismatch correction between sampler and trainer, the
reference model's sync and the adaptive entropy bonus. Names follow TRL 1.16's GRPOConfig where
grpokit has the same knob (docs/CONFIG.md lists the TRL name of each field).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpokit.config.checks import check, check_fields, did_you_mean, one_of
from grpokit.config.variants import (
    ADVANTAGE_ESTIMATORS,
    CLIPPED_LOSSES,
    ENTROPY_AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTIONS,
    LOSS_KINDS,
    LOSS_TYPES,
    OLD_LOGPROBS,
    PRESET_NAMES,
    SCALE_REWARDS,
    STD_KINDS,
)


@dataclass(frozen=True)
class AlgorithmConfig:
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo
    beta: float = 0.0  # KL coefficient; 0 = no reference model is loaded
    epsilon: float = 0.2
    # 0 = same as epsilon (DAPO uses 0.28). With loss_type = "cispo" it is the cap on the importance weight
    # itself, as in TRL (ScaleRL's eps_max: 5.0); a value below 1 there is the old spelling, read as 1 + value.
    epsilon_high: float = 0.0
    # Two-sided clipping (INTELLECT-2): the unclipped ratio is capped at delta, which bounds the loss of
    # negative-advantage tokens whose ratio ran away; 0 = off. Must exceed 1 + epsilon_high (4.0 is usual).
    delta: float = 0.0
    scale_rewards: str = "group"  # group | batch | none (Dr. GRPO)
    std: str = "population"  # population | sample (TRL)
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    num_iterations: int = 1  # mu: passes over one generation batch
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False  # DAPO: drop zero-std groups, draw more prompts
    max_resample_rounds: int = 4  # extra prompt batches drawn per step at most
    # Old log-probs when μ > 1 (or several minibatches): "recompute" (a no-grad pass, as TRL),
    # "first_pass" (kept from the first pass's forward: exact, no extra pass; needs one minibatch),
    # "sampler" (the rollout's log-probs: no extra pass, differs from a recompute by float noise).
    old_logprobs: str = "recompute"
    # Variants (docs/VARIANTS.md): a named preset (grpo | dr_grpo | dapo | gspo | cispo | sapo | luspo | vespo;
    # see presets.py), resolved when the config is built from TOML/dict, under the fields you set yourself.
    preset: str = ""
    advantage_estimator: str = "grpo"  # grpo (group mean/std) | rloo (leave-one-out) | reinforce_pp
    # SAPO (soft adaptive gate): the clip is replaced by sigmoid(tau * (ratio - 1)) * 4 / tau, with tau for
    # positive and for non-positive advantages (the paper's 1.0 and 1.05)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # VESPO (smooth sequence-level gate): each answer's weight is phi(w) = e^lambda * w^k * e^(-lambda * w) of its
    # sequence ratio w, with (k, lambda) for non-negative and for negative advantages
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # Off-policy sequence masking (DeepSeek-V3.2): an answer with a negative advantage whose mean KL from the
    # sampling policy exceeds this threshold is left out of the policy term; 0 = off (0.5 is an example)
    off_policy_mask_threshold: float = 0.0
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * H_t, aggregated as entropy_aggregation says
    # How the entropy bonus is aggregated: "loss" = like the policy loss (coef * H_t per token, then the loss
    # type's own aggregation); "token_mean" = TRL 1.16's, coef times the plain mean token entropy of each
    # micro-batch whatever the loss type (the TRL drop-in's)
    entropy_aggregation: str = "loss"
    # Adaptive entropy coefficient (TRL's use_adaptive_entropy): after each optimizer step the coefficient
    # moves by entropy_coef_delta (up while the token entropy is at or below entropy_target, down above it),
    # within [entropy_coef_min, entropy_coef_max], starting at entropy_coef; the bonus acts only while the
    # entropy is at or below the target
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    top_entropy_quantile: float = 1.0  # < 1: policy term only on this top share of tokens by entropy
    kl_bias_correction: bool = False  # KL_t * ratio_t (DeepSeek-V3.2; TRL's use_bias_correction_kl)
    # Mismatch correction for a sampler whose log-probs are not the trainer's (vLLM; any engine): each
    # token's (token_*) or answer's (sequence_*) policy term is weighted by its ratio trainer/sampler, clipped
    # into [is_cap_min, is_cap_max] (*_truncate) or zeroed outside it (*_mask); "none" = off. TRL's
    # vllm_importance_sampling_mode / _clip_max / _clip_min; 0 = no bound on that side. "auto": off in sync
    # mode, token_truncate in rollout.mode = "async" (the sampler's weights lag the trainer's; docs/ASYNC.md)
    is_correction: str = "auto"
    is_cap_max: float = 3.0
    is_cap_min: float = 0.0
    # The earlier spelling of is_correction = "token_truncate" with is_cap_max = tis_cap; 0 = unset
    tis_cap: float = 0.0
    # Reference model sync (TR-DPO): every ref_sync_every steps the reference becomes
    # ref_mixup_alpha * policy + (1 - ref_mixup_alpha) * reference; 0 = never (needs beta > 0)
    ref_sync_every: int = 0
    ref_mixup_alpha: float = 0.6
    # Per-turn credit for multi-turn answers (docs/AGENTS.md): "none" = every turn gets the answer's advantage;
    # "gigpo" (GiGPO: step groups of identical environment states, discounted step returns; needs an environment
    # with get_state) or "mt_grpo" (MT-GRPO: each turn's reward normalised among the group at that turn)
    turn_advantage: str = "none"
    turn_advantage_weight: float = 1.0  # GiGPO's omega / MT-GRPO's lambda on the turn term (both papers: 1.0)
    turn_discount: float = 0.95  # GiGPO's gamma for the step returns (the paper's 0.95)

    def __post_init__(self):
        check_fields(self, "algorithm")
        check_preset(self.preset)
        one_of(self.advantage_estimator, ADVANTAGE_ESTIMATORS, "algorithm.advantage_estimator")
        check(self.advantage_estimator == "grpo" or self.scale_rewards == "group", "algorithm.scale_rewards",
               f"{self.scale_rewards!r} applies to advantage_estimator = 'grpo' only; "
               f"{self.advantage_estimator!r} sets its own scale (leave scale_rewards at 'group')")
        check(self.entropy_coef >= 0, "algorithm.entropy_coef", "must be >= 0 (0 = no entropy bonus)")
        one_of(self.entropy_aggregation, ENTROPY_AGGREGATIONS, "algorithm.entropy_aggregation")
        check(0 <= self.top_entropy_quantile <= 1, "algorithm.top_entropy_quantile",
               "must be in [0, 1] (1 = every token; 0.2 = the 20% highest-entropy tokens)")
        one_of(self.loss_type, LOSS_TYPES, "algorithm.loss_type")
        one_of(self.scale_rewards, SCALE_REWARDS, "algorithm.scale_rewards")
        one_of(self.std, STD_KINDS, "algorithm.std")
        one_of(self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS, "algorithm.importance_sampling_level")
        check(self.beta >= 0, "algorithm.beta", "must be >= 0 (0 disables the KL term)")
        check(0 < self.epsilon < 1, "algorithm.epsilon", "must be in (0, 1); 0.2 is usual")
        check(self.epsilon_high >= 0, "algorithm.epsilon_high", "must be >= 0 (0 = same as epsilon)")
        check(self.num_iterations >= 1, "algorithm.num_iterations", "must be >= 1")
        check(self.max_resample_rounds >= 0, "algorithm.max_resample_rounds", "must be >= 0")
        one_of(self.old_logprobs, OLD_LOGPROBS, "algorithm.old_logprobs")
        self._check_objective()
        self._check_corrections()
        self._check_turns()

    def _check_turns(self) -> None:
        one_of(self.turn_advantage, TURN_ADVANTAGES, "algorithm.turn_advantage")
        check(self.turn_advantage_weight >= 0, "algorithm.turn_advantage_weight",
               "must be >= 0 (0 = the turn term off; 1.0 is both papers')")
        check(0 <= self.turn_discount <= 1, "algorithm.turn_discount", "must be in [0, 1] (0.95 is GiGPO's)")

    def _check_objective(self) -> None:
        check(self.delta == 0 or LOSS_KINDS[self.loss_type].clipped, "algorithm.delta",
               f"two-sided clipping applies to the clipped losses ({', '.join(CLIPPED_LOSSES)}), not "
               f"loss_type = {self.loss_type!r}; set it to 0")
        check(self.delta == 0 or self.delta > 1 + self.clip_high, "algorithm.delta",
               f"must exceed 1 + epsilon_high ({1 + self.clip_high:g}) to cap only runaway ratios, or be 0 (off); "
               f"4.0 is usual")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            check(getattr(self, name) > 0, f"algorithm.{name}", "must be > 0")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            check(getattr(self, name) >= 0, f"algorithm.{name}", "must be >= 0")
        check(self.off_policy_mask_threshold >= 0, "algorithm.off_policy_mask_threshold",
               "must be >= 0 (0 = off; 0.5 is an example)")
        check(self.entropy_target >= 0, "algorithm.entropy_target", "must be >= 0 (nats per token)")
        check(self.entropy_coef_max >= 0, "algorithm.entropy_coef_max", "must be >= 0 (1.0 is TRL's)")
        check(0 <= self.entropy_coef_min <= self.entropy_coef_max, "algorithm.entropy_coef_min",
               f"must be in [0, entropy_coef_max = {self.entropy_coef_max:g}]")
        check(self.entropy_coef_delta > 0, "algorithm.entropy_coef_delta", "must be > 0 (0.005 is usual)")
        check(not self.adaptive_entropy or self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max,
               "algorithm.entropy_coef", f"the adaptive coefficient starts at entropy_coef, which must lie in "
               f"[entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min:g}, {self.entropy_coef_max:g}]")

    def _check_corrections(self) -> None:
        one_of(self.is_correction, IS_CORRECTIONS, "algorithm.is_correction")
        check(self.tis_cap >= 0, "algorithm.tis_cap", "must be >= 0 (0 = unset; prefer is_correction = "
               "\"token_truncate\" with is_cap_max)")
        if self.tis_cap:  # the earlier spelling: one value for the token-level truncation
            check(self.is_correction in ("auto", "none", "token_truncate") and self.is_cap_max in (3.0, self.tis_cap),
                   "algorithm.tis_cap", f"is the old spelling of is_correction = \"token_truncate\" with is_cap_max, "
                   f"and is_correction = {self.is_correction!r} / is_cap_max = {self.is_cap_max:g} are set too: "
                   f"keep one spelling")
            object.__setattr__(self, "is_correction", "token_truncate")
            object.__setattr__(self, "is_cap_max", self.tis_cap)
            object.__setattr__(self, "tis_cap", 0.0)  # recorded (config.toml) in the current spelling
        # a matched sampler's ratio is 1: a range without 1 would mask (or scale down) every token
        check(self.is_cap_max == 0 or self.is_cap_max >= 1, "algorithm.is_cap_max",
               "must be >= 1 (0 = no upper bound; 3.0 is TRL's): a bound below 1 masks or scales down every token, "
               "even where sampler and trainer agree")
        check(0 <= self.is_cap_min <= 1, "algorithm.is_cap_min",
               "must be in [0, 1] (0 = no lower bound): a bound above 1 masks or scales up every token, even where "
               "sampler and trainer agree")
        check(not (self.is_cap_max and self.is_cap_min >= self.is_cap_max), "algorithm.is_cap_min",
               f"must be below is_cap_max ({self.is_cap_max:g})")
        check(self.is_correction in ("auto", "none") or self.is_cap_max or self.is_cap_min, "algorithm.is_cap_max",
               f"is_correction = {self.is_correction!r} needs a bound: set is_cap_max (e.g. 3.0) or is_cap_min")
        check(self.loss_type != "vespo" or self.is_correction in ("auto", "none", "token_truncate", "token_mask"),
               "algorithm.is_correction", f"loss_type = 'vespo' folds the token-level correction into its sequence "
               f"weight: use 'token_truncate' or 'token_mask', not {self.is_correction!r}")
        check(self.ref_sync_every >= 0, "algorithm.ref_sync_every", "must be >= 0 (0 = never; TR-DPO syncs every "
                                                                   "few hundred steps)")
        check(0 < self.ref_mixup_alpha <= 1, "algorithm.ref_mixup_alpha",
               "must be in (0, 1] (1 = copy the policy; 0.6 is TRL's)")
        check(not self.ref_sync_every or self.beta > 0, "algorithm.ref_sync_every",
               "syncs the reference model, which exists only with beta > 0: set beta, or ref_sync_every = 0")

    @property
    def clip_high(self) -> float:
        return self.epsilon_high or self.epsilon

    @property
    def cispo_cap(self) -> float:
        """CISPO's cap on the importance weight: epsilon_high itself (TRL's meaning, ScaleRL's eps_max), or
        1 + epsilon_high for a value below 1 (the earlier grpokit spelling; `warnings` says so)."""
        e = self.clip_high
        return e if e >= 1 else 1.0 + e

    @property
    def sums_over_global_tokens(self) -> bool:
        """The loss divides by the token count of the whole minibatch over all processes (dapo, cispo, vespo):
        micro-batch losses and the processes' gradients add up, with no 1/n or 1/W scaling."""
        return LOSS_KINDS[self.loss_type].sums_over_global_tokens

    @property
    def uses_entropy(self) -> bool:
        """The loss reads per-token entropies (bonus, adaptive bonus or top-entropy mask)."""
        return self.entropy_coef > 0 or self.adaptive_entropy or self.top_entropy_quantile < 1

    @property
    def per_token_loss(self) -> bool:
        """The loss is a sum of terms each depending on one token's log-prob (the fused head's one-pass
        backward needs it): no sequence ratio, no sequence weight, no sequence mask."""
        return (self.importance_sampling_level == "token" and not LOSS_KINDS[self.loss_type].sequence_weight
                and not self.off_policy_mask_threshold)

    @property
    def warnings(self) -> list[tuple[str, str]]:
        """(key, message) for settings that run but are probably not what was meant (said once at start-up)."""
        out = []
        if self.loss_type == "cispo" and self.clip_high < 1:
            shown = f"epsilon_high = {self.epsilon_high:g}" if self.epsilon_high else "epsilon_high unset"
            out.append(("cispo_cap", f"algorithm.loss_type = 'cispo' with {shown}: read the old way, as a cap of "
                                     f"{self.cispo_cap:g} on the importance weight. epsilon_high is now the cap "
                                     f"itself (TRL's meaning; ScaleRL recommends 5.0): write epsilon_high = "
                                     f"{self.cispo_cap:g} to keep this cap; the old spelling will be removed."))
        if self.importance_sampling_level == "sequence" and LOSS_KINDS[self.loss_type].sums_token_terms:
            out.append(("sequence_ratio", f"algorithm.importance_sampling_level = 'sequence' with loss_type = "
                                          f"{self.loss_type!r}: that loss sums per-token terms, so each answer is "
                                          f"weighted by its length instead of optimizing the per-answer objective; "
                                          f"GSPO uses loss_type = 'grpo' (preset 'gspo'), LUSPO 'luspo'."))
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            out.append(("luspo_level", "algorithm.loss_type = 'luspo' with importance_sampling_level = 'token': the "
                                       "paper uses sequence-level ratios (preset 'luspo')."))
        if not self.adaptive_entropy and (self.entropy_target, self.entropy_coef_min, self.entropy_coef_max,
                                          self.entropy_coef_delta) != (0.2, 0.0, 1.0, 0.005):
            out.append(("adaptive_entropy", "algorithm.entropy_target / entropy_coef_min / _max / _delta are set but "
                                            "adaptive_entropy = false: they steer only the adaptive coefficient."))
        if self.loss_type == "luspo" and (self.entropy_coef or self.adaptive_entropy) and \
                self.entropy_aggregation == "loss":
            out.append(("luspo_entropy", "algorithm.loss_type = 'luspo' with an entropy bonus: the bonus is aggregated "
                                         "like the loss, summed over each answer's tokens, so it grows with the "
                                         "answer length; use a smaller entropy_coef (or entropy_coef_max), or "
                                         "entropy_aggregation = 'token_mean'."))
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            out.append(("vespo_level", "algorithm.loss_type = 'vespo' computes its own sequence weight: "
                                       "importance_sampling_level should stay 'token'."))
        for key, fields, unless, why in _INERT:
            changed = [f for f in fields if getattr(self, f) != _DEFAULTS[f]]
            if changed and not unless(self):
                out.append((key, f"algorithm.{' / '.join(changed)} {'is' if len(changed) == 1 else 'are'} set but "
                                 f"{why}: {'it changes' if len(changed) == 1 else 'they change'} nothing."))
        return out


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig)}
# (key, fields, when they act, why not here): options that only one setting reads, set away from their default
_INERT = [
    ("is_bounds", ("is_cap_max", "is_cap_min"), lambda a: a.is_correction != "none", "is_correction = 'none'"),
    ("ref_mixup", ("ref_mixup_alpha",), lambda a: a.ref_sync_every > 0, "ref_sync_every = 0"),
    ("turn_weight", ("turn_advantage_weight",), lambda a: a.turn_advantage != "none", "turn_advantage = 'none'"),
    ("turn_discount", ("turn_discount",), lambda a: a.turn_advantage == "gigpo", "turn_advantage is not 'gigpo'"),
    ("sapo_temperature", ("sapo_temperature_pos", "sapo_temperature_neg"), lambda a: a.loss_type == "sapo",
     "loss_type is not 'sapo'"),
    ("vespo_gate", ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
     lambda a: a.loss_type == "vespo", "loss_type is not 'vespo'"),
    ("entropy_aggregation", ("entropy_aggregation",), lambda a: a.entropy_coef > 0 or a.adaptive_entropy,
     "there is no entropy bonus (entropy_coef = 0, adaptive_entropy = false)"),
]


TURN_ADVANTAGES = ("none", "gigpo", "mt_grpo")  # algorithms/turn_advantages.py names the same; a test keeps them equal


def check_preset(name) -> None:
    check(name == "" or (isinstance(name, str) and name in PRESET_NAMES), "algorithm.preset",
           f"unknown preset {name!r}{did_you_mean(str(name), PRESET_NAMES)}; choose one of {', '.join(PRESET_NAMES)} "
           "(or leave it empty)")
