"""Writes a tiny Llama model vLLM can serve, made here (no download).

2 layers, hidden 128, random bf16 weights; a byte-level BPE tokenizer
trained on generated ASCII text (every token decodes to visible text, so
vLLM sends one SSE chunk per token), with a chat template.

Special tokens must never be sampled (an EOS would end a request early, a
<pad> would decode to nothing and send no chunk): Llama has no output bias,
so residual dimension 0 is made a constant (every embedding has 10 there
and no layer writes to it), which after the final RMSNorm is always
positive, and the special tokens' lm_head rows are -1000 on that dimension
only: their logits are always around -10^4. Each request then yields
exactly max_tokens tokens, which the tests count.

usage: python tiny_model.py OUT_DIR
"""

import json
import os
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<s>", "</s>", "<pad>"]
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def corpus(n=4000, seed=7):
    rnd = random.Random(seed)
    words = ["token", "trace", "latency", "engine", "batch", "queue", "prefill",
             "stream", "request", "server", "kernel", "socket", "model", "step"]
    for _ in range(n):
        text = " ".join(rnd.choice(words) + str(rnd.randint(0, 99)) for _ in range(12))
        # The characters of the chat template, so prompts tokenize fully.
        yield f"user: {text}\nassistant: {text}\n"


def tokenizer(out):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=SPECIAL,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    # Some transformers versions keep the template in its own file only.
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f)
    return fast


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    fast = tokenizer(out)
    vocab = len(fast)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        # Dimension 0 of the residual stream: constant 10, never written.
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        for tid in fast.convert_tokens_to_ids(SPECIAL):
            model.lm_head.weight[tid] = 0.0
            model.lm_head.weight[tid, 0] = -1000.0
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}, f)
    print(f"tiny model: vocab {vocab}, written to {out}")


if __name__ == "__main__":
    main()
