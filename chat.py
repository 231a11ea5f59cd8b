"""An interactive chat loop over one static KV cache (generate.py --interactive).

    python generate.py --interactive                     # the embedded model
    python generate.py --interactive --compile --checkpoint PATH

Each turn re-renders the whole conversation with the model's chat template, finds the longest
prefix whose K/V are already in the cache, and prefills only the tokens after it: a long chat
costs each turn only its new tokens.
"""
import torch

from generate import Streamer, autotune, compile_decode, decode_one, generate, log, make_cache, memory_plan
from sampling import SamplingParams


def interactive(args, model, tokenizer, device):
    """A chat loop over one static cache. Each turn re-renders the conversation with the chat
    template and prefills only the tokens after the longest prefix already in the cache."""
    seq_len = args.max_seq_len or min(model.args.max_position_embeddings, 4096)
    cache = make_cache(args, model, 1, seq_len)
    log(memory_plan(model, cache) + "\nType a message; an empty line or Ctrl-D ends the chat.")
    decode_fn = compile_decode(device, autotune=autotune(model)) if args.compile else decode_one
    generator = torch.Generator(device=device)
    if args.seed is not None:
        generator.manual_seed(args.seed)
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    messages, cached = [], []  # cached: the token ids whose K/V are in the cache, in order
    while True:
        try:
            text = input("\n>>> ")
        except EOFError:
            break
        if not text.strip():
            break
        messages.append({"role": "user", "content": text})
        ids = tokenizer.encode_chat(messages)
        common = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
        common = min(common, len(ids) - 1)  # at least one token to prefill
        if len(ids) + args.max_new_tokens > seq_len:
            log(f"the conversation ({len(ids)} tokens) + --max_new_tokens would exceed --max_seq_len {seq_len}; ending")
            break
        streamer = Streamer(tokenizer, tokenizer.stop_ids)
        prompt = torch.tensor([ids[common:]], device=device)
        rows, timing = generate(model, cache, prompt, args.max_new_tokens, params, generator, tokenizer.stop_ids,
                                False, decode_fn, start_pos=common, on_token=streamer)
        streamer.flush()
        print()
        log(f"[{len(ids) - common} new prompt tokens of {len(ids)}, {timing['tokens_per_s']:.1f} tokens/s]")
        reply = rows[0]
        cached = ids + reply[:-1] if reply and reply[-1] in tokenizer.stop_ids else ids + reply
        messages.append({"role": "assistant", "content": streamer.printed})
    return 0
