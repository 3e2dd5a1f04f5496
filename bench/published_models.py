"""The public config.json numbers of checkpoints the operator has no preset for, which the published
rows (bench/memory_published_rows.py, bench/throughput_published_rows.py) ran: one copy for both."""

LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "tie_word_embeddings": False, "max_position_embeddings": 4096}
LLAMA2_13B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
              "tie_word_embeddings": False, "max_position_embeddings": 4096}
LLAMA2_70B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "tie_word_embeddings": False, "max_position_embeddings": 4096}
YI_34B = {"model_type": "llama", "vocab_size": 64000, "hidden_size": 7168, "intermediate_size": 20480,
          "num_hidden_layers": 60, "num_attention_heads": 56, "num_key_value_heads": 8,
          "tie_word_embeddings": False, "max_position_embeddings": 4096}
MISTRAL_7B_V02 = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "tie_word_embeddings": False, "max_position_embeddings": 32768, "sliding_window": None}
# stabilityai/stablelm-base-alpha-3b (GPT-NeoX).
STABLELM_ALPHA_3B = {"model_type": "gpt_neox", "vocab_size": 50688, "hidden_size": 4096, "intermediate_size": 16384,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "max_position_embeddings": 4096,
                     "rotary_pct": 0.25, "use_parallel_residual": True, "tie_word_embeddings": False}
