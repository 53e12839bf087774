"""A CPU stand-in for vLLM's offline API: just enough of `vllm.LLM` for grpokit's VLLMEngine.

Not vLLM: a Hugging Face model sampled with grpokit's own sampler, whose weights change only
through `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` (as vLLM's in-process
engine) and whose LoRA adapters come from `LoRARequest` folders. grpokit's tests run the real vLLM
(its CPU build, tests/real_vllm); this stand-in is for the faults a real server cannot be made to show
and for scripts/check_vllm_gpu.py's own logic. It lets the logic of
`engines.VLLMEngine` and of `scripts/check_vllm_gpu.py` run where vLLM cannot:

    GRPOKIT_CHECK_DEVICE=cpu PYTHONPATH=tests/fake_vllm python scripts/check_vllm_gpu.py --out /tmp/check
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

__version__ = "0.0+cpu-stand-in"


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LoRARequest:
    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


class _Loadable:
    def __init__(self, model):
        self.hf = model

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters(remove_duplicate=False))  # a tied head by its name too
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor.to(params[name].dtype))


class LLM:
    """A vision-language folder loads as image-text-to-text with its processor: a request's `multi_modal_data`
    images are encoded by the processor's image processor, and its token ids (placeholders already expanded,
    as grpokit sends them and vLLM detects) are sampled with those pixels."""

    def __init__(self, model: str, dtype: str = "bfloat16", seed: int = 0, enable_lora: bool = False, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from grpokit.models.vision import has_vision_tower, load_processor, vision_family

        config = AutoConfig.from_pretrained(model)
        self.family = vision_family(config) if has_vision_tower(config) else None
        self.processor = load_processor(model) if self.family else None
        loader = AutoModelForImageTextToText if self.family else AutoModelForCausalLM
        self.hf = loader.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model = _Loadable(self.hf)
        self.reloads = 0  # reload_weights calls (scripts/check_vllm_gpu.py counts them)
        self.llm_engine = SimpleNamespace(remove_lora=lambda lora_id: None)
        self._adapter = (None, None)  # (id, merged model)

    def _model(self, lora_request):
        if lora_request is None:
            return self.hf
        if self._adapter[0] != lora_request.lora_int_id:
            import copy

            from peft import PeftModel

            merged = PeftModel.from_pretrained(copy.deepcopy(self.hf), lora_request.lora_path).merge_and_unload()
            self._adapter = (lora_request.lora_int_id, merged)
        return self._adapter[1]

    def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
        from grpokit.rollout.decode import sample_groups
        from grpokit.rollout.request import RolloutRequest, SamplingParams

        model = self._model(lora_request)
        several = isinstance(sampling_params, list)  # vLLM takes one SamplingParams per prompt too
        per_prompt = sampling_params if several else [sampling_params] * len(prompts)
        g = torch.Generator().manual_seed(per_prompt[0].seed or 0)
        out = []
        for prompt, p in zip(prompts, per_prompt):
            if several:
                g = torch.Generator().manual_seed(p.seed or 0)
            sampling = SamplingParams(p.max_tokens, tuple(p.stop_token_ids or ()), 0, p.temperature, p.top_p, p.top_k)
            r = sample_groups(model, RolloutRequest([prompt["prompt_token_ids"]], p.n, sampling, g,
                                                    media=self._media(prompt)))
            answers = []
            for j in range(p.n):
                ids = r.completion_ids[j, :int(r.completion_mask[j].sum())].tolist()
                logprobs = [{t: SimpleNamespace(logprob=float(r.logprobs[j, k]), rank=1)} for k, t in enumerate(ids)]
                answers.append(SimpleNamespace(token_ids=ids, logprobs=logprobs,
                                               finish_reason="length" if bool(r.truncated[j]) else "stop"))
            out.append(SimpleNamespace(outputs=answers, prompt_token_ids=prompt["prompt_token_ids"]))
        return out

    def _media(self, prompt):
        """The request's images as the sampler takes them (None without any)."""
        images = (prompt.get("multi_modal_data") or {}).get("image")
        if images is None:
            return None
        if self.family is None:
            raise ValueError("multi_modal_data for a text-only model")
        from grpokit.models.media import PromptImages, RowMedia

        encoded = self.processor.image_processor(images=[images] if self.family == "idefics3" else images,
                                                 return_tensors="pt")
        return RowMedia(self.family, (PromptImages.from_processor(self.family, encoded),),
                        int(self.hf.config.image_token_id))

    def collective_rpc(self, method, args=(), kwargs=None):
        if method != "reload_weights":
            raise NotImplementedError(method)
        self.model.load_weights((kwargs or {})["weights_iterator"])
        self.reloads += 1

    def reset_prefix_cache(self):
        pass

    def sleep(self, level: int = 1):
        pass

    def wake_up(self, tags=None):
        pass
