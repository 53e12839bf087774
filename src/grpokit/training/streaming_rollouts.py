"""Streaming groups in sync mode (`rollout.partial_rollouts`, docs/STREAMING.md): the loop's batches come from
a pool of groups in progress (rollout/streaming.py) that keeps the decode rows full; the rest of the step (grading,
advantages, the update, the correction of the lag) is the sync loop's."""

from __future__ import annotations

import time

from grpokit.errors import SetupError
from grpokit.models.fsdp import full_params_for_generation
from grpokit.models.onednn import packed_linears
from grpokit.models.parallel import world_size
from grpokit.observe.metrics import version_metrics
from grpokit.rollout.decode import DecodeSpeed
from grpokit.rollout.engines import HFEngine
from grpokit.rollout.grading import Draw, grade
from grpokit.rollout.streaming import GroupPool, check_full_attention, groups_rollout
from grpokit.training.generate import generate_and_grade


class StreamingRollouts:
    """`rollout.partial_rollouts` in sync mode (docs/STREAMING.md): the steps' groups come from a pool that keeps
    its decode rows full (rollout/streaming.py). It stands in for the side and the prompt stream of
    `generate_and_grade`, which grades and takes advantages as for any batch: `next_batch` decodes until B
    groups are complete and names their rows, `draw` grades those groups (rollout/grading.py's `grade`, as
    `RolloutSide.draw` does after sampling). As the run's stream (`run.stream`) its checkpointed position holds
    the prompts in flight, which a resumed run samples again first (data/prompts.py `replay`). Publishing and
    closing are `sync`'s (training/rollout_source.py SyncRollouts: the sampler is the training model)."""

    def __init__(self, config, run, sync):
        check_streaming_run(run)
        self.run, self.sync = run, sync
        local, side, self.prompts = run.inputs.local, run.side, run.stream
        self.specs, self.sampling, self.B, self.version = side.specs, side.sampling, local.train.prompts_per_step, 0
        self.groups, self.sample_s, self.restarted = [], 0.0, 0
        self.pool = GroupPool(run.policy.model, side.sampling, side.group_size, self._next_prompt,
                              rows=local.generation_batch_size, tokenizer=side.tokenizer,
                              speed=DecodeSpeed.from_config(local), generator=run.sampling_generator,
                              max_staleness=local.rollout.max_staleness)
        run.stream = self  # the checkpoint's position: the stream's, with the prompts in flight to replay

    def _next_prompt(self) -> tuple[int, list[int]]:
        row = self.prompts.next_row()
        return row, self.run.side.prompts.ids[row]

    def next(self, step: int):
        if self.sync.failed is not None:
            raise self.sync.failed
        self.version = step - 1  # the weights the model holds: those after optimizer step `step - 1`
        batch, metrics = generate_and_grade(self.run.inputs.local, self, self, self.run.sampling_generator, step)
        rows = self.pool.decode_rows
        metrics.update(version_metrics(batch.draw.rollout.token_version, batch.draw.rollout.action_mask, step - 1))
        metrics.update({"rollout/decode_rows_mean": sum(rows) / max(1, len(rows)),
                        "rollout/groups_restarted": float(self.pool.restarted - self.restarted),
                        "rollout/groups_in_flight": float(len(self.pool.in_flight()))})
        self.restarted = self.pool.restarted
        return batch, metrics

    def next_batch(self) -> list[int]:
        """Decode until B groups are complete; their rows (what `generate_and_grade` hands `draw`)."""
        model, r = self.run.policy.model, self.run.inputs.local.rollout
        t0 = time.perf_counter()
        with full_params_for_generation(model), packed_linears(model, self.pool.rows, r.packed_weights):
            self.groups = self.pool.take(self.B, self.version)
        self.sample_s = time.perf_counter() - t0
        return [g.item for g in self.groups]

    def draw(self, indices, *, generator=None, log_metric=None, trainer_state=None) -> Draw:
        """The groups `next_batch` completed, graded."""
        t0, side = time.perf_counter(), self.run.side
        rollout = groups_rollout(self.groups, side.group_size, side.sampling.pad_token_id)
        draw = grade(rollout, [side.prompts.rows[i] for i in indices], side.tokenizer, side.specs, side.group_size,
                     prompt_column=side.prompt_column, log_metric=log_metric, trainer_state=trainer_state)
        draw.sample_s, draw.grade_s = self.sample_s, time.perf_counter() - t0
        return draw

    def publish(self, model, step: int) -> dict:
        self.groups = []  # step's groups are trained: a checkpoint no longer replays them
        return self.sync.publish(model, step)

    def close(self) -> None:
        self.sync.close()

    def state_dict(self) -> dict:
        """The stream's position, with the prompts taken and not trained to replay first: in the pool, and the
        groups handed on for a step that did not finish (a checkpoint of the step before, written on a failure)."""
        state = self.prompts.state_dict()
        replay = self.pool.in_flight(self.groups) + list(self.prompts.replay)
        return {**state, "replay": replay} if replay else state

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


def check_streaming_run(run) -> None:
    """What `rollout.partial_rollouts` cannot do with this run's inputs (config/checks.py refuses the fields)."""
    inputs, what = run.inputs, None
    if inputs.tools is not None or inputs.environments is not None:
        what = "tools or environments (multi-turn rollouts, a task's own tools: tools.task_tools = false)"
    elif inputs.prompts.media is not None:
        what = "prompts with images"
    elif world_size() > 1:
        what = f"{world_size()} trainer processes (torchrun)"
    elif not isinstance(run.side.engine, HFEngine):
        what = "train(engine=...)"
    if what is not None:
        raise SetupError(f"rollout.partial_rollouts: {what} is not built yet; set rollout.partial_rollouts = false")
    check_full_attention(run.policy.model.config, "rollout.partial_rollouts")
