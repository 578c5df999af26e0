"""Configuration of a Recurrent Looped Transformer (RLT) for Hugging Face ``transformers``.

Written into every export by ``rlt-mega export`` (with ``modeling_rlt.py``), so that
``AutoConfig.from_pretrained(EXPORT, trust_remote_code=True)`` reads ``config.json`` without
rlt_mega installed. The field names are rlt_mega's ``ModelConfig``; ``attribute_map`` also
answers to the usual Hugging Face names (``hidden_size``, ``num_hidden_layers``,
``max_position_embeddings``, ...), which tools such as lm-evaluation-harness read.
"""

from transformers import PretrainedConfig


class RLTConfig(PretrainedConfig):
    model_type = "rlt"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "ffn_hidden",
        "max_position_embeddings": "max_seq_len",
        "rms_norm_eps": "norm_eps",
    }

    def __init__(self, vocab_size=260, d_model=128, n_layers=2, n_heads=4, n_kv_heads=None, ffn_hidden=None,
                 memory_block=1, rope_theta=10000.0, norm_eps=1e-6, share_weights=True, tie_embeddings=False,
                 qkv_bias=False, init_std=0.02, embed_init_std=None, max_seq_len=2048, use_cache=True,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None, **kwargs):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        # rlt_mega's default: SwiGLU 8/3 d rounded up to a multiple of 64
        self.ffn_hidden = 64 * ((8 * d_model // 3 + 63) // 64) if ffn_hidden is None else ffn_hidden
        self.memory_block = memory_block  # C: memory is committed in blocks of C positions
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.share_weights = share_weights
        self.tie_embeddings = tie_embeddings
        self.qkv_bias = qkv_bias
        self.init_std = init_std
        self.embed_init_std = (init_std if tie_embeddings else 1.0) if embed_init_std is None else embed_init_std
        self.max_seq_len = max_seq_len
        self.use_cache = use_cache
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        if d_model % n_heads != 0 or (d_model // n_heads) % 2 != 0:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads} with an even head dim (RoPE)")
        if n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={n_heads}")
        if memory_block < 1:
            raise ValueError(f"memory_block={memory_block} must be >= 1")
        # The model ties lm_head to embed itself (it has no separate lm_head when tied), so
        # transformers' own tying is told nothing to do.
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
