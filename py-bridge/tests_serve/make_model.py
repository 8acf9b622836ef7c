"""Makes a small Qwen3 model that real `vllm serve` loads on a CPU, with nothing downloaded.

    python make_model.py OUT_DIR [--shape tiny|one-kv-head|seed|mla]

Weights are random from a fixed seed (`transformers`' Qwen3ForCausalLM, safetensors; DeepSeek-V2
for `mla`); the
tokenizer is a byte-level BPE trained here with `tokenizers` on generated text, with bos/eos and a
ChatML-like chat template. The same arguments give the same files. Shapes:

- `tiny`: 4 layers, 2 KV heads, head_dim 64, hidden 256, float32: 4 KiB of KV per token, loads
  in ~30 s.
- `seed`: the seed's KV bytes per token (Qwen3-8B's 36 layers × 8 KV heads × 128 × 2 B in bf16;
  here 36 × 8 × 64 × 4 B in float32) with a small hidden size: 147,456 B of KV per token, so a
  1000-token prompt moves the seed's ~142 MiB.
- `mla`: a DeepSeek-V2 with multi-head latent attention, 4 dense layers, one latent of 576 values
  per token per layer (kv_lora_rank 512 + rope 64, what vLLM's CPU MLA kernel takes), float32:
  9 KiB of KV per token, the same on every tensor-parallel rank.

Plain random weights make a model that repeats one token whatever the prompt, which would hide a
wrong KV. Scaled (embeddings ×50, q/k norms ×3, v/o projections ×10, output head ×25), it
attends sharply, its greedy tokens vary, and changing one early prompt token changes them: each
output depends on the KV of the whole context.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

SHAPES = {
    "tiny": dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=64, hidden_size=256, num_attention_heads=4, intermediate_size=512),
    # One KV head: at tensor-parallel size 2 each rank holds a replica of it.
    "one-kv-head": dict(num_hidden_layers=4, num_key_value_heads=1, head_dim=64, hidden_size=256, num_attention_heads=2, intermediate_size=512),
    "seed": dict(num_hidden_layers=36, num_key_value_heads=8, head_dim=64, hidden_size=256, num_attention_heads=8, intermediate_size=512),
    # DeepSeek-V2 attention: each layer caches one latent (kv_lora_rank + qk_rope_head_dim values per
    # token); every layer dense (first_k_dense_replace = the layer count), so no MoE runs.
    "mla": dict(
        num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=4, hidden_size=256, intermediate_size=512,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, head_dim=64,
        first_k_dense_replace=4, n_routed_experts=4, moe_intermediate_size=64, num_experts_per_tok=2,
    ),
}
#: float32: on CPUs with AMX, vLLM 0.32's CPU attention runs bf16 at block sizes that are multiples
#: of 32 on its AMX kernel, which dies (SIGILL) when a request resumes mid-block after an external
#: KV load, as every P/D connector's D does; float32 runs the portable kernel. Greedy tokens of two
#: servers also compare exactly in float32.
DTYPES = {"tiny": "float32", "one-kv-head": "float32", "seed": "float32", "mla": "float32"}
VOCAB = 2048
MAX_POSITIONS = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKER = "pdflow-model.json"


def corpus(rng: random.Random, n: int = 4000) -> list[str]:
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(1500)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + rng.choice([".", "?", "!", ""]) for _ in range(n)]


def make_tokenizer(out: str, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)


def make_weights(out: str, shape: dict, dtype: str, eos_id: int, bos_id: int) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    mla = "kv_lora_rank" in shape
    torch.manual_seed(0)
    config = (DeepseekV2Config if mla else Qwen3Config)(
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        torch_dtype=dtype,
        **shape,
    )
    model = (DeepseekV2ForCausalLM if mla else Qwen3ForCausalLM)(config)
    with torch.no_grad():  # see the module's doc
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(25.0)
        for layer in model.model.layers:
            attn = layer.self_attn
            if mla:
                attn.kv_a_layernorm.weight.mul_(3.0)
                attn.kv_b_proj.weight.mul_(10.0)
            else:
                attn.q_norm.weight.mul_(3.0)
                attn.k_norm.weight.mul_(3.0)
                attn.v_proj.weight.mul_(10.0)
            attn.o_proj.weight.mul_(10.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f)


def kv_bytes_per_token(shape: dict, dtype: str) -> int:
    if "kv_lora_rank" in shape:  # one latent per layer, K and V together
        return shape["num_hidden_layers"] * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) * (4 if dtype == "float32" else 2)
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * (4 if dtype == "float32" else 2)


def make(out: str, shape_name: str) -> dict:
    """Makes the model in `out` unless it is already there; returns its description."""
    shape, dtype = SHAPES[shape_name], DTYPES[shape_name]
    desc = {"shape": shape_name, **shape, "dtype": dtype, "vocab_size": VOCAB, "kv_bytes_per_token": kv_bytes_per_token(shape, dtype), "version": 2}
    marker = os.path.join(out, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == desc:
                return desc
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    make_tokenizer(out, rng)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    make_weights(out, shape, dtype, eos_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    with open(marker, "w") as f:
        json.dump(desc, f)
    return desc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = ap.parse_args()
    print(json.dumps(make(args.out, args.shape)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
