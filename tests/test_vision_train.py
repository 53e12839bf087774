"""Training a tiny vision-language model end to end, from Python rows and from the CLI, and its bad inputs.

Each run is a few steps of GRPO on image rows: the language model's weights move, the vision tower's
stay (unless `model.train_vision_tower`), the metrics rows are written, the reward functions receive
the image column, and the checkpoint loads back as the image-text-to-text model it is (processor too).
Bad input is refused in the first second, before any model loads.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import grpokit.training.rollout_setup as rollout_setup
import grpokit.training.setup as setup_mod
from conftest import make_config
from grpokit import train
from grpokit.cli import main
from grpokit.errors import DataError, SetupError
from grpokit.models.tiny_vision import build_tiny_vlm
from grpokit.models.vision import load_processor

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    out = {}
    for arch in ("qwen2_vl", "idefics3", "gemma3"):
        out[arch] = tmp_path_factory.mktemp(arch)
        build_tiny_vlm(out[arch], arch=arch, hidden_size=32, num_layers=1, seed=1)
    return out


def _rows(n=4):
    names = list(COLORS)
    return [{"prompt": [{"role": "user", "content": "colour?"}], "image": Image.new("RGB", (32, 32), COLORS[c]),
             "answer": c} for c in (names[i % 3] for i in range(n))]


def distinct_letters(completions, image, **kwargs):
    """A reward that varies between answers (so the groups carry signal) and checks the image column."""
    assert all(isinstance(im, Image.Image) for im in image)
    return [float(len(set(c[-1]["content"]))) for c in completions]


def _config(model_dir, out, **sections):
    return make_config(model_dir, out, steps=2, prompts_per_step=2, max_new_tokens=4, learning_rate=1e-2,
                       **sections)


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def _last_checkpoint(run):
    return sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3", "gemma3"])
def test_a_tiny_vlm_trains_from_image_rows(vlm_dirs, tmp_path, arch):
    from transformers import AutoModelForImageTextToText

    # is_correction: the trainer scores the sampled tokens before the update and reports its gap to the sampler
    config = _config(vlm_dirs[arch], tmp_path / "run", output={"completions_every": 1},
                     algorithm={"is_correction": "token_truncate"})
    run = train(config, rows=_rows(), reward_functions=[distinct_letters])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["grad_norm"] > 0 for m in metrics)
    assert all(m["sampling/logprob_gap_max"] < 1e-4 for m in metrics)  # the pixels reach sampler and trainer alike
    assert len((run / "completions.jsonl").read_text().splitlines()) == 2 * 2 * 4  # steps x prompts x answers
    before, after = _weights(vlm_dirs[arch]), _weights(_last_checkpoint(run))
    tower = ("visual." if arch == "qwen2_vl" else "vision_model.")
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(".layers.0." in k for k in moved)  # the decoder learned
    assert not any(tower in k for k in moved)  # the vision tower is frozen by default
    model = AutoModelForImageTextToText.from_pretrained(str(_last_checkpoint(run)))  # a VLM checkpoint, processor too
    assert model.config.model_type == arch and load_processor(_last_checkpoint(run)).image_processor is not None


def test_train_vision_tower_trains_it(vlm_dirs, tmp_path):
    run = train(_config(vlm_dirs["qwen2_vl"], tmp_path / "run", model={"train_vision_tower": True}), rows=_rows(),
                reward_functions=[distinct_letters])
    before, after = _weights(vlm_dirs["qwen2_vl"]), _weights(_last_checkpoint(run))
    assert any("visual." in k and not torch.equal(before[k], after[k]) for k in before)


def test_cli_trains_from_a_jsonl_with_image_files(vlm_dirs, tmp_path, capsys):
    (tmp_path / "img").mkdir()
    lines = []
    for i, (name, color) in enumerate(COLORS.items()):
        Image.new("RGB", (24, 32), color).save(tmp_path / "img" / f"{name}.png")
        lines.append(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": "colour?"}]}],
                                 "images": [f"img/{name}.png"], "answer": name}))
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "run.toml").write_text(f"""
[model]
path = "{vlm_dirs['idefics3']}"
[data]
path = "{tmp_path / 'data.jsonl'}"
[rewards]
functions = ["format"]
args = {{format = {{pattern = "^[a-z]+$"}}}}
[rollout]
group_size = 2
max_new_tokens = 3
[train]
steps = 2
prompts_per_step = 2
learning_rate = 0.01
[output]
dir = "{tmp_path / 'run'}"
console = false
""")
    assert main(["train", str(tmp_path / "run.toml")]) == 0, capsys.readouterr().err
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(setup_mod, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(setup_mod.vision_setup, "load_vision_model", lambda *a, **k: pytest.fail("the model loaded"))


def test_image_rows_with_a_text_only_model_are_refused_before_it_loads(tiny_model_dir, tmp_path, no_model_load):
    with pytest.raises(DataError, match=r"'image' column but .* text-only model \(model_type 'qwen2'\).*tiny-model"):
        train(_config(tiny_model_dir, tmp_path / "run"), rows=_rows(), reward_functions=[distinct_letters])
    assert not (tmp_path / "run").exists()


def test_train_vision_tower_with_a_text_only_model_is_refused(tiny_model_dir, tmp_path, no_model_load):
    with pytest.raises(SetupError, match="model.train_vision_tower: .* text-only model"):
        train(_config(tiny_model_dir, tmp_path / "run", model={"train_vision_tower": True}),
              reward_functions=[distinct_letters])


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Counter:
    """An environment: one instance per answer."""

    def reset(self, **row):
        self.n = 0

    def bump(self, by: int) -> int:
        """Add to the count.

        Args:
            by: how much
        """
        self.n += by
        return self.n


def test_what_is_not_built_with_images_is_refused(vlm_dirs, tmp_path, no_model_load):
    """Image rows with an environment, with tools.history = "split", or with tools on the vLLM engine; and tools
    whose chat template cannot show them (this VLM's template has no tools): each one error naming the field,
    before the model loads."""
    import dataclasses

    from grpokit.config.schema import ToolsConfig

    config = _config(vlm_dirs["qwen2_vl"], tmp_path / "run")
    with pytest.raises(SetupError, match="^tools.environment: environments with image rows .* not built yet"):
        train(config, rows=_rows(), environment_factory=Counter, reward_functions=[distinct_letters])
    with pytest.raises(SetupError, match='^tools.history: tools.history = "split" with images is not built yet'):
        train(dataclasses.replace(config, tools=ToolsConfig(history="split")), rows=_rows(), tools=[add],
              reward_functions=[distinct_letters])
    from types import SimpleNamespace

    from grpokit.config.options import VLLMOptions
    from grpokit.training.vision_setup import _refuse_unbuilt  # a config with the vllm engine needs vLLM installed

    on_vllm = SimpleNamespace(tools=SimpleNamespace(history="append"),
                              rollout=SimpleNamespace(engine="vllm", vllm={}, vllm_options=VLLMOptions()))
    with pytest.raises(SetupError, match="^rollout.engine: the vLLM engine with images in multi-turn rollouts is "
                                         "not built yet"):
        _refuse_unbuilt(on_vllm, environments=False, tools=True)
    _refuse_unbuilt(on_vllm, environments=False, tools=False)  # single-turn: vLLM takes the images
    on_vllm.rollout.vllm = {"server": "http://localhost:8000"}  # token-id prompts over HTTP carry no pixels
    on_vllm.rollout.vllm_options = VLLMOptions.of(on_vllm.rollout.vllm)
    with pytest.raises(SetupError, match="^rollout.vllm.server: a vLLM server with images .* not built yet"):
        _refuse_unbuilt(on_vllm, environments=False, tools=False)
    with pytest.raises(SetupError, match="^tools: .*the chat template ignores the tools"):
        train(config, rows=_rows(), tools=[add], reward_functions=[distinct_letters])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_async_rollout_with_images_at_max_staleness_0_is_the_sync_loop(vlm_dirs, tmp_path, arch):
    """The worker process loads the image-text-to-text class and the processor, encodes its steps' images and
    sends them with the answers: the same metrics and weights as sync (docs/ASYNC.md's max_staleness = 0)."""
    from conftest import comparable

    def run(out, **rollout):
        return train(_config(vlm_dirs[arch], tmp_path / out, rollout=rollout,
                             train={"num_threads": 1, "learning_rate": 1e-3},
                             output={"completions_every": 1}), rows=_rows(), reward_functions=[distinct_letters])

    sync, async_ = run("sync"), run("async", mode="async", max_staleness=0)
    a, b = (comparable([json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]) for r in (sync, async_))
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert y["async/staleness_max"] == 0
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    w_sync, w_async = _weights(_last_checkpoint(sync)), _weights(_last_checkpoint(async_))
    base = _weights(vlm_dirs[arch])
    for name in w_sync:  # Adam moves a weight whose gradient is ~0 by up to lr: float noise, 1% of a step here
        torch.testing.assert_close(w_async[name], w_sync[name], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(w_async[n], base[n]) for n in w_async)  # it trained
    logged = [json.loads(x) for x in (async_ / "completions.jsonl").read_text().splitlines()]
    assert all(len(r["images"]) == 1 for r in logged)  # each answer names its prompt's image


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_evaluation_during_training_sees_the_held_out_images(vlm_dirs, tmp_path, arch):
    """`[eval]` with image rows: the loop's eval/ metrics at the last step equal `evaluate` run on the saved
    checkpoint with those rows' pixels (the same seed), and the reward functions get the held-out images."""
    from transformers import AutoModelForImageTextToText

    from grpokit.demo_vision import encoded_rows
    from grpokit.models.media import RowMedia
    from grpokit.rollout.request import SamplingParams
    from grpokit.training.evaluation import EvalSettings, evaluate

    held_out = [{**row, "image": Image.new("RGB", (32, 32), (i * 60, 250 - i * 50, 90))} for i, row in
                enumerate(_rows(3))]
    seen = []

    def looks(completions, image, **kwargs):
        seen.extend(im.getpixel((0, 0)) for im in image)
        return distinct_letters(completions, image)

    eval_section = {"every": 1, "num_prompts": 3, "samples_per_prompt": 2, "greedy": True}
    run = train(_config(vlm_dirs[arch], tmp_path / "run", eval=eval_section), rows=_rows(), eval_rows=held_out,
                reward_functions=[looks])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "eval/accuracy" in r] == [1, 2]
    assert {row["image"].getpixel((0, 0)) for row in held_out} <= set(seen)

    checkpoint = _last_checkpoint(run)
    model = AutoModelForImageTextToText.from_pretrained(str(checkpoint))
    processor = load_processor(str(checkpoint))
    encoded = encoded_rows(processor, model.config, held_out)
    media = RowMedia.concat([m for _, m in encoded], [1] * len(encoded))
    direct = evaluate(model, processor.tokenizer, held_out, [i for i, _ in encoded],
                      [s for s in rollout_setup.resolve_reward_specs(_config(vlm_dirs[arch], tmp_path / "x"), None,
                                                                      [distinct_letters], rows=held_out)],
                      EvalSettings(SamplingParams(4, pad_token_id=processor.tokenizer.pad_token_id),
                                   samples_per_prompt=2, seed=0), media=media)
    last = logged[-1]
    for key in ("accuracy", "mean_reward", "pass@2", "greedy_accuracy"):
        assert last[f"eval/{key}"] == pytest.approx(direct[key], abs=1e-9), key


def test_held_out_images_are_checked_before_the_model_loads(vlm_dirs, tiny_model_dir, tmp_path, no_model_load):
    eval_section = {"every": 1, "num_prompts": 2}
    broken = [{**row, "image": str(tmp_path / "missing.png")} for row in _rows(2)]
    with pytest.raises(DataError, match="^the held-out rows: .*missing.png"):
        train(_config(vlm_dirs["qwen2_vl"], tmp_path / "run", eval=eval_section), rows=_rows(), eval_rows=broken,
              reward_functions=[distinct_letters])
    with pytest.raises(DataError, match=r"^the held-out rows: .* text-only model \(model_type 'qwen2'\)"):
        train(_config(tiny_model_dir, tmp_path / "run", eval=eval_section), eval_rows=_rows(2),
              rows=[{k: v for k, v in row.items() if k != "image"} for row in _rows(2)],
              reward_functions=[lambda completions, **kwargs: [0.0] * len(completions)])
    assert not (tmp_path / "run").exists()


def test_more_image_tokens_than_the_context_holds_is_named(tmp_path, no_model_load):
    build_tiny_vlm(tmp_path / "small", arch="idefics3", hidden_size=32, num_layers=1, max_positions=40)
    with pytest.raises(DataError, match=r"prompt row 1 has 31 tokens \(4 of them for its 1 image\(s\)\); with "
                                        r"rollout.max_new_tokens = 10 .* context of 40: use smaller images"):
        train(_config(tmp_path / "small", tmp_path / "run", rollout={"max_new_tokens": 10}), rows=_rows(),
              reward_functions=[distinct_letters])


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_an_image_placeholder_without_an_image_is_refused_naming_the_row(vlm_dirs, tmp_path, arch, no_model_load):
    """Issue 43 point 5: with no row holding an image, the placeholders were not counted, and `<|image_pad|>` was
    trained on with no pixels behind it."""
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    rows = [{"prompt": [{"role": "user", "content": "colour?"}], "images": [], "answer": "red"},
            {"prompt": question, "images": [], "answer": "red"}] * 2
    with pytest.raises(DataError, match=r"^row 2: the prompt has 1 image placeholder\(s\) \(\{'type': 'image'\} "
                                        r"parts\) but column 'images' holds no image; give the image"):
        train(_config(vlm_dirs[arch], tmp_path / "run"), rows=rows,
              reward_functions=[lambda completions, **kwargs: [0.0] * len(completions)])
    assert not (tmp_path / "run").exists()


def test_an_image_the_processor_refuses_for_its_aspect_ratio_names_the_row_and_the_cause(vlm_dirs, tmp_path,
                                                                                        no_model_load):
    """Issue 43 point 10: a 1000 x 2 image was "the model's chat template and its processor disagree", no row."""
    rows = _rows(3)
    rows[2] = {**rows[2], "image": Image.new("RGB", (1000, 2), (1, 2, 3))}
    with pytest.raises(DataError, match=r"^row 3: image 1 is 1000 x 2 pixels, an aspect ratio of 500, which the "
                                        r"qwen2_vl processor refuses \(.*\); crop or pad it"):
        train(_config(vlm_dirs["qwen2_vl"], tmp_path / "run"), rows=rows, reward_functions=[distinct_letters])


def test_lora_adapts_the_language_model_only(vlm_dirs, tmp_path):
    from grpokit.models.lora import apply_lora

    for arch, outside in (("qwen2_vl", ("visual",)), ("idefics3", ("vision_model", "connector")),
                          ("gemma3", ("vision_tower", "multi_modal_projector"))):
        model, _ = build_tiny_vlm(arch=arch, hidden_size=32, num_layers=1)
        adapted = {name for name, _ in apply_lora(model, {"r": 2}).named_modules() if name.endswith("lora_A")}
        assert adapted and not any(f".{part}." in name for name in adapted for part in outside)
        assert any(".layers.0.self_attn.q_proj" in name for name in adapted)
    run = train(_config(vlm_dirs["idefics3"], tmp_path / "run", model={"lora": {"r": 4}}), rows=_rows(),
                reward_functions=[distinct_letters])
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_trl_drop_ins_evaluate_samples_from_the_rows_images(vlm_dirs, tmp_path, monkeypatch):
    """`GRPOTrainer.evaluate()` draws through the rollout side training uses: image rows are rendered by the
    model folder's processor and their pixels reach the sampler, as in the evaluation during training."""
    from grpokit.rollout.engines import HFEngine
    from grpokit.trl import GRPOConfig, GRPOTrainer

    given, real = [], HFEngine.generate

    def spy(self, request):
        given.append(None if request.media is None else request.media.num_images)
        return real(self, request)

    monkeypatch.setattr(HFEngine, "generate", spy)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, disable_tqdm=True)
    trainer = GRPOTrainer(str(vlm_dirs["gemma3"]), distinct_letters, args=args, train_dataset=_rows(),
                          eval_dataset=_rows(3))
    metrics = trainer.evaluate()
    assert given == [[1, 1, 1]]  # one batch of the 3 prompts, each with its image
    assert metrics["eval_reward"] > 0  # graded, the reward functions given the images (distinct_letters checks)


def test_grpokit_eval_renders_a_vision_tasks_images_for_a_vision_language_model(vlm_dirs, tiny_model_dir, capsys):
    """`grpokit eval --task shapes` on a tiny Qwen2-VL: the model loads as image-text-to-text and each prompt is
    sampled with its image's pixels (the figures equal `evaluate` given them); a text-only model is refused."""
    from transformers import AutoModelForImageTextToText

    from grpokit.demo_vision import encoded_rows
    from grpokit.models.media import RowMedia
    from grpokit.rollout.request import SamplingParams
    from grpokit.tasks import get_task
    from grpokit.training.evaluation import EvalSettings, evaluate

    args = ["eval", "--task", "shapes", "--num-prompts", "3", "--samples", "2", "--max-new-tokens", "3", "--json"]
    assert main([*args[:1], "--model", str(vlm_dirs["qwen2_vl"]), *args[1:]]) == 0
    result = json.loads(capsys.readouterr().out)
    task = get_task("shapes")
    rows = task.generate(3, seed=12345, split="eval")
    model = AutoModelForImageTextToText.from_pretrained(str(vlm_dirs["qwen2_vl"]))
    encoded = encoded_rows(load_processor(str(vlm_dirs["qwen2_vl"])), model.config, rows)
    tokenizer = load_processor(str(vlm_dirs["qwen2_vl"])).tokenizer
    direct = evaluate(model, tokenizer, rows, [i for i, _ in encoded], task.reward_functions(),
                      EvalSettings(SamplingParams(3, pad_token_id=tokenizer.pad_token_id), samples_per_prompt=2,
                                   seed=0), media=RowMedia.concat([m for _, m in encoded], [1] * len(encoded)))
    for key in ("accuracy", "mean_reward", "pass@2", "greedy_accuracy"):
        assert result[key] == pytest.approx(direct[key], abs=1e-9), key

    assert main([*args[:1], "--model", str(tiny_model_dir), *args[1:]]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'image' column but" in err[0] and "text-only model (model_type 'qwen2')" in err[0]


def test_grpokit_eval_runs_tools_with_image_rows_and_refuses_gemma3_before_the_weights_load(vlm_dirs, tmp_path,
                                                                                           capsys, monkeypatch):
    """With --tool and image rows: a VLM whose template shows tools evaluates (prompts rendered with the tools'
    schemas by the processor); Gemma 3 (sliding-window layers) is one error before its weights load."""
    import grpokit.training.vision_setup as vision_setup
    from grpokit.models.tiny_vision import build_tiny_vlm

    (tmp_path / "calc.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: one\n'
                                      '        b: two\n    """\n    return a + b\n')
    args = ["--task", "shapes", "--num-prompts", "2", "--samples", "2", "--max-new-tokens", "8", "--json",
            "--tool", f"{tmp_path / 'calc.py'}:add"]
    build_tiny_vlm(tmp_path / "q", arch="qwen2_vl", hidden_size=32, num_layers=1, seed=1, tools=True)
    assert main(["eval", "--model", str(tmp_path / "q"), *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 2 and "tool_call_share" in result
    monkeypatch.setattr(vision_setup, "load_vision_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["eval", "--model", str(vlm_dirs["gemma3"]), *args]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --model {vlm_dirs['gemma3']}: tools: multi-turn rollouts need "
                                               "plain full attention in every layer")


def _fake_vllm():
    """tests/fake_vllm (a CPU stand-in for vLLM's offline API), loaded under its own name."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "fake_vllm" / "vllm" / "__init__.py"
    spec = importlib.util.spec_from_file_location("grpokit_fake_vllm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3"])
def test_the_vllm_engine_sends_each_prompts_images_as_multimodal_data(vlm_dirs, tmp_path, arch):
    """`rollout.engine = "vllm"` with image rows: each request carries its prompt's token ids (placeholders
    expanded) and its decoded images as `multi_modal_data`; the answers come back with their prompt's images for
    the trainer, and the weights pushed after each update keep sampler and trainer together (the stand-in encodes
    the images with the processor, as vLLM's own processor does). Checked on CPU against tests/fake_vllm; the real
    vLLM path is the GPU check's (scripts/check_vllm_gpu.py)."""
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.rollout.vllm.colocated import ColocatedLLM

    fake, sent = _fake_vllm(), []

    def engine(config, model, tokenizer):
        llm = fake.LLM(model=config.model.path, dtype="float32")
        generate = llm.generate
        llm.generate = lambda prompts, **kw: sent.extend(prompts) or generate(prompts, **kw)
        return VLLMEngine(ColocatedLLM(llm, fake))

    config = _config(vlm_dirs[arch], tmp_path / "run", output={"completions_every": 1},
                     algorithm={"is_correction": "token_truncate"})
    run = train(config, rows=_rows(), reward_functions=[distinct_letters], engine=engine)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["sampling/logprob_gap_max"] < 1e-4 for m in metrics)  # the pixels and the new weights reached it
    assert len(sent) == 4 and all(len(p["multi_modal_data"]["image"]) == 1 for p in sent)
    colors = [p["multi_modal_data"]["image"][0].getpixel((0, 0)) for p in sent]
    assert set(colors) <= set(COLORS.values()) and len(set(colors)) > 1  # each prompt its own image
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert all(len(r["images"]) == 1 for r in records)


@pytest.mark.parametrize("damage", ["processor_config.json", "video_preprocessor_config.json", "chat_template.jinja"])
def test_a_damaged_processor_file_is_one_error_naming_it(vlm_dirs, tmp_path, damage):
    """A damaged processor file or a chat template without the image placeholders: one error naming the file and
    the fix, before the run folder is made (both were tracebacks out of transformers)."""
    import shutil

    from grpokit.errors import ModelLoadError

    folder = tmp_path / "vlm"
    shutil.copytree(vlm_dirs["qwen2_vl"], folder)
    (folder / damage).write_text("{broken")
    match = "chat template and its processor disagree" if damage.endswith(".jinja") else \
        f"{damage} is not valid JSON .*copy the processor files from the base model again"
    with pytest.raises(ModelLoadError, match=match):
        train(_config(folder, tmp_path / "run"), rows=_rows(), reward_functions=[distinct_letters])
    assert not (tmp_path / "run").exists()
