"""Per-turn credit end to end: what the rollout records of each turn (step rewards from tools and
environments, start states), the loss with per-token advantages, the start-up errors, and a run.

The random tiny model writes no call syntax, so turns are scripted as in test_multiturn.py: a turn ends
at a digit or "=", and every turn "calls" add(a=len(turn), b=1).
"""

from __future__ import annotations

import math

import pytest
import torch

import grpokit.training.update as update
from conftest import make_config
from grpokit.algorithms.objectives import LossSpec, policy_loss
from grpokit.config.algorithm import AlgorithmConfig
from grpokit.errors import EnvironmentFault, SetupError
from grpokit.models.loading import load_model, load_tokenizer
from grpokit.observe.tracking import read_metrics
from grpokit.rollout.environments import Environments
from grpokit.rollout.multiturn import sample_conversations
from grpokit.rollout.request import RolloutRequest, SamplingParams
from grpokit.rollout.tools import ToolBox, ToolCall, WithReward
from grpokit.training.loop import train
from grpokit.training.turn_credit import check_turn_setup
from test_tools_training import final_parity, scripted_engine


class Walker:
    """Counts its steps (the state: so the G answers meet the same states), rewards odd `a` per step."""

    def reset(self, **row):
        self.steps = 0

    def add(self, a: int, b: int) -> int:
        """Take a step.

        Args:
            a: A number.
            b: Another number.
        """
        self.steps += 1
        self.last = a
        return a + b

    def get_turn_reward(self) -> float:
        return float(self.last % 2)

    def get_state(self):
        return ["steps", self.steps]  # a list: compared as a tuple


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu").eval(), load_tokenizer(tiny_model_dir)


def _sample(tiny, tools, prompts=("12+7=", "3+45="), G=3, seed=0):
    model, tok = tiny
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789="]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    request = RolloutRequest(ids, G, SamplingParams(24, tuple(digits), tok.pad_token_id),
                             torch.Generator().manual_seed(seed), tools=tools)
    return sample_conversations(
        model, request, tokenizer=tok, max_tool_turns=2,
        parse_calls=lambda text, **_: [ToolCall("add", {"a": len(text), "b": 1})],
        render_results=lambda results: tok.encode("<" + ",".join(r.content for r in results) + ">",
                                                  add_special_tokens=False))


def _env_boxes(cls, n):
    environments = Environments(cls)
    boxes, _ = environments.start([{"prompt": "x"}] * n)
    return environments, boxes


def test_the_rollout_records_each_turns_tokens_step_reward_and_start_state(tiny):
    environments, boxes = _env_boxes(Walker, 6)
    rollout, stats = _sample(tiny, boxes)
    turns = rollout.turns
    assert turns.counts.tolist() == stats.turns and max(stats.turns) > 1
    action = rollout.action_mask.bool()
    assert (turns.token_turn[~action] == -1).all() and (turns.token_turn[action] >= 0).all()
    for i, n in enumerate(stats.turns):
        seen = turns.token_turn[i][action[i]]
        assert seen.unique().tolist() == list(range(n)) and (seen.diff() >= 0).all()  # each turn's tokens, in order
        env = environments.active[i]
        ran = env.steps  # the turns whose calls ran; their rewards are the environment's
        assert (~torch.isnan(turns.rewards[i, :n])).sum().item() == ran
        if ran:
            assert turns.rewards[i, ran - 1].item() == float(env.last % 2)
    # turn k starts after k steps: the same state, the same id, in every answer that has a turn k
    for k in range(turns.states.shape[1]):
        has = turns.counts > k
        assert turns.states[has, k].unique().numel() == 1
    assert turns.states[:, 0].unique().numel() == 1 and (turns.states[turns.counts == 1, 1:] == -1).all()


def test_a_tools_with_reward_is_the_turns_step_reward_and_a_bad_one_a_failed_call(tiny):
    def add(a: int, b: int):
        """Add.

        Args:
            a: A number.
            b: Another number.
        """
        return WithReward(a + b, reward=0.5 if a > 1 else float("nan"))

    rollout, stats = _sample(tiny, ToolBox([add]))
    turns = rollout.turns
    results = [m for c in stats.conversations for m in c if m["role"] == "tool"]
    assert any(m["content"].isdigit() for m in results)  # the value is shown, not the wrapper
    failed = [m for m in results if "error" in m["content"]]
    assert all("a step reward must be a finite number" in m["content"] for m in failed)
    assert sum(stats.failures) >= max(1, len(failed))  # (a failed result that did not fit is not shown)
    reported = turns.rewards[~torch.isnan(turns.rewards)]
    assert reported.numel() and (reported == 0.5).all()  # failed calls report none
    assert (turns.states == -1).all()  # plain tools report no state


def test_a_turn_reward_or_state_of_the_wrong_type_is_one_error_naming_the_environment(tiny):
    class Texty(Walker):
        def get_turn_reward(self):
            return "good"

    class Opaque(Walker):
        def get_state(self):
            return {"seen": {1, 2}, "where": [object.__new__(Unhashable)]}

    class Unhashable:
        __hash__ = None

    with pytest.raises(EnvironmentFault, match=r"environment Texty: get_turn_reward returned 'good' \(str\); it "
                                                r"must return the turn's step reward as a finite number"):
        _sample(tiny, _env_boxes(Texty, 6)[1])
    with pytest.raises(EnvironmentFault, match=r"environment Opaque: get_state returned .* cannot be compared"):
        _sample(tiny, _env_boxes(Opaque, 6)[1])


def test_per_token_advantages_apply_to_their_own_tokens_only():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.5]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 1]])
    adv = torch.tensor([[2.0, 2.0, 9.0, -1.0]], dtype=torch.float64)  # token 2 is a tool result: masked
    loss, _ = policy_loss(logp, None, adv, mask, LossSpec(loss_type="dapo"))
    loss.backward()
    # on-policy dapo: loss = -sum_t A_t / 3 tokens (ratio 1), d loss / d logp_t = -A_t / 3 on the mask
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -2 / 3, 0.0, 1 / 3]], dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"])
def test_per_token_advantages_equal_per_answer_ones_where_each_answer_has_one(loss_type):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    old = logp + 0.1 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    adv = torch.tensor([0.7, -1.2, 0.3], dtype=torch.float64)
    spec = LossSpec(loss_type=loss_type, max_completion_length=5, epsilon_high=5.0 if loss_type == "cispo" else 0.2)
    a, _ = policy_loss(logp, old, adv, mask, spec)
    b, _ = policy_loss(logp, old, adv[:, None].expand(3, 5), mask, spec)
    torch.testing.assert_close(a, b)


def test_settings_turn_credit_cannot_serve_are_refused_at_start(tool_model_dir, tmp_path):  # noqa: F811
    def config(**algorithm):
        return make_config(tool_model_dir, tmp_path / "run", algorithm=algorithm)

    with pytest.raises(SetupError, match=r"algorithm.turn_advantage = 'gigpo' credits the turns of multi-turn "
                                         r"answers, and this run has no tools or environment"):
        train(config(turn_advantage="gigpo"), tools=[])
    stateless = type("Stateless", (), {"reset": lambda self, **row: None})
    with pytest.raises(SetupError, match=r"groups turns by the environment state .* environment Stateless has no "
                                         r"get_state\(\) method"):
        train(config(turn_advantage="gigpo"), environment_factory=stateless)
    box = ToolBox([Walker().add])
    with pytest.raises(SetupError, match="this run has no environment, so it has no get_state"):
        check_turn_setup(config(turn_advantage="gigpo"), box, None)
    check_turn_setup(config(turn_advantage="mt_grpo"), box, None)  # tools' WithReward rewards are enough
    gdpo = make_config(tool_model_dir, tmp_path / "run", algorithm={"turn_advantage": "gigpo"})
    gdpo = type(gdpo)(**{**gdpo.__dict__, "rewards": type(gdpo.rewards)(aggregation="normalize_then_sum")})
    with pytest.raises(SetupError, match="rewards.aggregation = \"sum_then_normalize\""):
        check_turn_setup(gdpo, box, Environments(Walker))
    with pytest.raises(Exception, match="algorithm.turn_advantage: got 'gipo'"):
        AlgorithmConfig(turn_advantage="gipo")
    with pytest.raises(Exception, match=r"algorithm.turn_discount: must be in \[0, 1\]"):
        AlgorithmConfig(turn_advantage="gigpo", turn_discount=1.5)


@pytest.mark.parametrize("estimator", ["gigpo", "mt_grpo"])
def test_a_run_trains_with_per_turn_advantages_on_each_turns_tokens(tool_model_dir, tmp_path, monkeypatch,  # noqa: F811
                                                                    estimator):
    seen = []
    real = update.policy_loss

    def spy(logp, old_logp, advantages, mask, **kwargs):
        seen.append((advantages.detach().clone(), mask.clone()))
        return real(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(update, "policy_loss", spy)
    config = make_config(tool_model_dir, tmp_path / "run", steps=2, max_new_tokens=48,
                         algorithm={"turn_advantage": estimator})
    run = train(config, reward_functions=[final_parity], environment_factory=Walker,
                engine=scripted_engine(None))  # add(a=len(turn), b=1): the step reward is a's parity
    metrics = read_metrics(run)
    for m in metrics:
        assert math.isfinite(m["loss"]) and "turns/0/advantage_mean" in m and m["turns/reward_share"] > 0
        assert 0 < m["turns/0/reward_mean"] < 1  # some steps rewarded, some not
    if estimator == "gigpo":
        assert metrics[0]["turns/step_group_size"] > 1  # the answers met the same states
    advantages, mask = seen[0]
    assert advantages.dim() == 2 and advantages.shape == mask.shape
    varies = [(row[m.bool()].unique().numel() > 1) for row, m in zip(advantages, mask)]
    assert any(varies)  # some answer's turns got different advantages


def test_turns_travel_with_their_answers_when_draws_are_filtered_and_joined():
    from grpokit.rollout.batch import Rollout, Turns, concat_rollouts
    from grpokit.rollout.grading import Draw

    def draw(T, K, first, signal=True):
        n = 2
        turns = Turns(torch.full((n, T), first, dtype=torch.long), torch.full((n, K), float(first)),
                      torch.full((n, K), first, dtype=torch.long), torch.full((n,), K, dtype=torch.long))
        ones = torch.ones(n, T, dtype=torch.long)
        rollout = Rollout(ones, ones, ones, ones, torch.zeros(n, T), torch.zeros(n, dtype=torch.bool), turns=turns)
        return Draw(rollout, torch.zeros(n, 1), torch.tensor([0.0, float(signal)]), ["p"] * n, ["t"] * n)

    joined = concat_rollouts([draw(3, 1, 1).rollout, draw(5, 2, 2).rollout], pad_token_id=0).turns
    assert joined.token_turn.tolist()[0] == [1, 1, 1, -1, -1] and joined.token_turn.tolist()[2] == [2] * 5
    assert joined.states.tolist() == [[1, -1], [1, -1], [2, 2], [2, 2]] and torch.isnan(joined.rewards[0, 1])
    # the first draw's group has no signal (dynamic sampling drops it): the second's answers keep their turns
    kept = Draw.join([draw(3, 1, 1, signal=False).with_signal(2), draw(5, 2, 2).with_signal(2)], 2, 0, draw(3, 1, 1))
    assert kept.rollout.turns.counts.tolist() == [2, 2] and kept.rollout.turns.states[:, 0].tolist() == [2, 2]


def test_a_tool_worker_sends_the_step_reward_back_with_the_result():
    """tools.isolation = "process": what a worker returns for a call rebuilds the whole `ToolResult`, the
    `WithReward` step reward included (it was once dropped on the way back, so per-turn credit lost it)."""
    from grpokit.rollout.tool_workers import ToolHost
    from grpokit.rollout.tools import ToolResult

    def scored(a: int) -> int:
        """Score.

        Args:
            a: a number
        """
        return WithReward(a, reward=0.25)

    (reply,) = ToolHost([scored], {}, 5.0, 1000)("call", [(0, [("scored", {"a": 3}, None)])])
    (result,) = [ToolResult(*r) for r in reply]
    assert result == ToolResult("scored", "3", False, 0.25)
