"""transformers configuration of a gptspeed GPT with its architecture switches (written by
``gptspeed export-hf``; self-contained: it needs transformers, not gptspeed).

The fields are gptspeed's own (``GPTConfig``), with GPT-2's names for the shape: ``n_positions`` is
the run's sequence length (``block_size``), ``vocab_size`` the tokenizer's 50,257 tokens (the
padding rows of the run's embedding are not exported). ``tie_word_embeddings`` stays false:
the model reads a tied head from the token embedding itself (``tie_embeddings``), so transformers'
own tying never runs. ``softmax_ids``: a ``--softmax data`` run's token ids (those of its training
data, sorted); every other id of the first ``softmax_vocab`` (the exported ``vocab_size``: ids added
later are not masked) gets logit -inf, probability 0, as in gptspeed (None: every id).
"""

from transformers import PretrainedConfig


class GptspeedConfig(PretrainedConfig):
    model_type = "gptspeed_gpt"
    attribute_map = {
        "hidden_size": "n_embd",
        "max_position_embeddings": "n_positions",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    def __init__(
        self,
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        pos_emb="learned",
        rope_theta=10000.0,
        qk_norm=False,
        mlp="gelu",
        norm="layernorm",
        tie_embeddings=True,
        logit_softcap=0.0,
        doc_mask=False,
        value_embeds=0,
        unet_skips=False,
        softmax_ids=None,
        softmax_vocab=None,
        eot_token_id=50256,
        use_cache=True,
        bos_token_id=50256,
        eos_token_id=50256,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.pos_emb = pos_emb  # "learned" | "rope"
        self.rope_theta = rope_theta
        self.qk_norm = qk_norm
        self.mlp = mlp  # "gelu" (tanh) | "relu2"
        self.norm = norm  # "layernorm" | "rmsnorm"
        self.tie_embeddings = tie_embeddings
        self.logit_softcap = logit_softcap  # 0: off
        self.doc_mask = doc_mask  # attention never crosses eot_token_id
        self.value_embeds = value_embeds  # 0: off
        self.unet_skips = unet_skips
        self.softmax_ids = softmax_ids  # None: every id; else the ids outside it have probability 0
        self.softmax_vocab = softmax_vocab if softmax_vocab is not None else vocab_size  # the ids it covers
        self.eot_token_id = eot_token_id
        self.use_cache = use_cache
        kwargs["tie_word_embeddings"] = False
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)
