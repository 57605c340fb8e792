"""Tiny random transformers configs (hidden 32, 2 layers, 4 heads, SDPA-capable) shared by the
zoo tests: name -> (config factory, model class)."""

from __future__ import annotations

import transformers as T

VOCAB = 128


def _llama_like(config_cls, **extra):
    return lambda: config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)


# name -> (config factory, model class). Gemma2 is left out: transformers refuses SDPA for it
# (it needs attention-logit soft-capping), so Gemma3's text model stands for the Gemma family.
DECODERS = {
    "llama": (_llama_like(T.LlamaConfig), T.LlamaForCausalLM),
    "qwen2": (_llama_like(T.Qwen2Config), T.Qwen2ForCausalLM),
    "qwen3": (_llama_like(T.Qwen3Config, head_dim=8), T.Qwen3ForCausalLM),
    "mistral": (_llama_like(T.MistralConfig, sliding_window=8), T.MistralForCausalLM),
    "gemma3": (_llama_like(T.Gemma3TextConfig, head_dim=8, sliding_window=8), T.Gemma3ForCausalLM),
    "phi3": (_llama_like(T.Phi3Config), T.Phi3ForCausalLM),
    "gpt2": (lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=1, eos_token_id=2), T.GPT2LMHeadModel),
    "gpt_neox": (lambda: T.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=128, bos_token_id=1,
                                         eos_token_id=2), T.GPTNeoXForCausalLM),
    "opt": (lambda: T.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=32,
                                bos_token_id=1, eos_token_id=2, pad_token_id=0), T.OPTForCausalLM),
}
ENCODERS = {
    "bert": (lambda: T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64), T.BertModel),
    "roberta": (lambda: T.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=64, pad_token_id=1,
                                        bos_token_id=0, eos_token_id=2), T.RobertaModel),
}
OTHERS = {
    "t5": (lambda: T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                              num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                              decoder_start_token_id=0), T.T5ForConditionalGeneration),
    "vit": (lambda: T.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64), T.ViTModel),
}
ZOO = {**DECODERS, **ENCODERS, **OTHERS}
