"""A tiny reward model to try `rewards.functions = ["runs/tiny-rm"]` with, built by hand in a second.

A reward model is a sequence-classification model with one output (`num_labels = 1`), such as one
trained with TRL's RewardTrainer; grpokit scores prompt + answer with it as TRL does. This one is not
trained: its weights are set so that it scores +1 when the text ends in a digit and -1 otherwise (the
decoder layers add nothing, so the last hidden state is the last character's embedding, +1s for a
digit and -1s for anything else, and the score head averages it). A tiny policy learns from it to end
its answers in a digit.

    .venv/bin/python examples/make_reward_model.py runs/tiny-rm
    .venv/bin/grpokit train examples/reward_model.toml
"""

import sys

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from grpokit.models.tiny import build_char_tokenizer

out = sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-rm"
tokenizer = build_char_tokenizer()  # the character tokenizer grpokit's tiny models use
hidden = 8
config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                              max_position_embeddings=256, rms_norm_eps=0.0, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
model = AutoModelForSequenceClassification.from_config(config)
with torch.no_grad():
    digits = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    sign = torch.tensor([1.0 if i in digits else -1.0 for i in range(len(tokenizer))])  # [V]
    model.model.embed_tokens.weight.copy_(sign[:, None].expand(-1, hidden))  # RMS 1: the final norm keeps it
    for layer in model.model.layers:  # the residual stream passes through unchanged
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    model.score.weight.fill_(1.0 / hidden)  # [1, hidden]: the mean of the last token's embedding = +-1
model.save_pretrained(out)
tokenizer.save_pretrained(out)
print(f"reward model saved to {out}: +1 for a text that ends in a digit, -1 otherwise")
