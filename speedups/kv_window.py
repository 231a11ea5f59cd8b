"""A static KV cache whose sliding-window layers keep only their window, as ring buffers.

A layer that attends to the last `window` keys never reads older ones, so its cache need not
hold them. kv_cache.StaticKVCache keeps every position and masks the old ones (the slow twin,
which tests compare against); here a windowed layer's K/V live in a ring of

    R = window + MARGIN slots (rounded up to 64, at most the cache's length)

position p at slot p % R, with `held[layer] [B, R]` recording which position each slot holds
(-1: none yet). A step attends over the whole ring under the mask "held <= p and held > p - window",
so a decode step reads R slots however long the context (benchmarks/RESULTS.md, "Sliding
windows"), and the layer's memory is R slots, not max_seq_len: Gemma 3 (five windowed layers of
six) or Mistral v0.1 at a long context hold a fraction of a full cache.

Writes come before attention when the step's T tokens cannot evict a key one of its queries
still needs (T <= R - window + 1: MARGIN covers decode, speculative verification and short
chunks, whose rejected tokens are overwritten in place later). A longer prefill attends over the
ring and its own keys side by side (ring entries at or past its first position are left over from
an earlier use, not keys), then writes only its last R tokens.

    cache = WindowedKVCache.for_model(model, batch_size=1, max_seq_len=32768)
    logits = model(tokens, input_pos, cache)  # the model is unchanged; layers without a window
                                              # use the plain path
"""

import torch

import cpu_kernels
from kv_cache import StaticKVCache, attention

MARGIN = 64  # slots past the window: a step of up to MARGIN + 1 tokens writes before it attends


def ring_size(window: int, max_seq_len: int) -> int:
    return min(max_seq_len, -(-(window + MARGIN) // 64) * 64)


class WindowedKVCache(StaticKVCache):
    """StaticKVCache with ring buffers for the windowed layers (module docstring); windows[layer]: 0
    or its window."""

    def __init__(
        self,
        n_layers,
        batch_size,
        n_kv_heads,
        max_seq_len,
        head_dim,
        dtype=torch.float32,
        device=None,
        decode=None,
        windows=(),
    ):
        super().__init__(
            n_layers, batch_size, n_kv_heads, 1, head_dim, dtype, device, decode
        )  # rebuilt below
        self.windows = list(windows) or [0] * n_layers
        self.ring = [
            ring_size(w, max_seq_len) if w and ring_size(w, max_seq_len) < max_seq_len else 0
            for w in self.windows
        ]
        self.k, self.v, self.held = [], [], []
        for R in self.ring:
            shape = (batch_size, n_kv_heads, R or max_seq_len, head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))
            self.held.append(torch.full((batch_size, R), -1, dtype=torch.long, device=device))
        self.slots = torch.arange(max_seq_len, device=device)
        self.max_seq_len = self.attend_len = max_seq_len
        # how far a caller may move back (generate.py --interactive): the rings keep window keys
        # behind it
        self.rewind_limit = min(
            (R - w for R, w in zip(self.ring, self.windows) if R), default=max_seq_len
        )

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int):
        a, w = model.config, model.norm.weight  # the activations' dtype and device
        decode = (
            cpu_kernels.static_decode if w.device.type == "cpu" else None
        )  # as StaticKVCache.for_model
        return cls(
            a.n_layers,
            batch_size,
            a.n_kv_heads,
            max_seq_len,
            a.head_dim,
            w.dtype,
            w.device,
            decode,
            [layer.self_attn.window for layer in model.layers],
        )

    def attend(self, layer, q, k, v, input_pos, window=0, softcap=0.0, sinks=None):
        # q [B, T, H, D]; k, v [B, T, Hkv, D]; input_pos [B, T] -> [B, T, H, D]
        R = self.ring[layer]
        if not R:
            return super().attend(layer, q, k, v, input_pos, window, softcap, sinks)
        B, T = input_pos.shape
        k_ring, v_ring, held = self.k[layer], self.v[layer], self.held[layer]
        if T <= R - window + 1:  # writing first evicts no key these queries need
            self._write(layer, k, v, input_pos)
            keys, values, positions = k_ring, v_ring, held
        else:  # a long prefill: the ring and the step's own keys side by side
            keys = torch.cat(
                (k_ring, k.transpose(1, 2).to(k_ring.dtype)), dim=2
            )  # [B, Hkv, R + T, D]
            values = torch.cat((v_ring, v.transpose(1, 2).to(v_ring.dtype)), dim=2)
            stale = (
                held[:B] >= input_pos[:, :1]
            )  # entries from an earlier use at or past this chunk: not keys
            positions = torch.cat((held[:B].masked_fill(stale, -1), input_pos), dim=1)  # [B, R + T]
        p, s = input_pos[:, None, :, None], positions[:B, None, None, :]
        mask = (s >= 0) & (s <= p) & (s > p - window)  # [B, 1, T, R (+ T)]
        if T == 1 and self.decode is not None and not softcap and sinks is None:
            y = self.decode(q, keys[:B], values[:B], mask)
        else:
            y = attention(q, keys[:B], values[:B], mask, softcap, sinks)
        if T > R - window + 1:
            self._write(layer, k[:, -R:], v[:, -R:], input_pos[:, -R:])
        return y

    def _write(self, layer, k, v, input_pos):
        """k, v [B, t, Hkv, D] at positions input_pos [B, t] (t <= R: no slot written twice)."""
        rows, slots = self.rows[: k.shape[0], None], input_pos % self.ring[layer]
        self.k[layer][rows, :, slots] = k.to(self.k[layer].dtype)
        self.v[layer][rows, :, slots] = v.to(self.v[layer].dtype)
        self.held[layer][rows, slots] = input_pos

    def reset(self):
        super().reset()
        for h in self.held:
            h.fill_(-1)
