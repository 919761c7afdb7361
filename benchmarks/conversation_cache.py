"""Conversation-cache benchmark: a two-turn conversation's second turn through `strata serve`'s
scheduler, with the cache (the parked session resumed: only the new tokens fed) and without it
(the whole conversation fed again), on one pack.

    python benchmarks/conversation_cache.py PACK [--turn1 1000] [--new 30] [--reply 8] [--chunk 1024]
                                           [--threads N]

Turn 1 is --turn1 random token ids (ids, not text: a random model's reply need not re-encode to the
tokens it sampled), answered greedily with --reply tokens; turn 2 is turn 1's tokens, its reply and
--new more ids. Each configuration runs on a fresh scheduler over the same loaded model, and the two
second replies must be the same tokens (the benchmark says so, or fails).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--turn1", type=int, default=1000, help="turn 1's prompt tokens")
    ap.add_argument("--new", type=int, default=30, help="turn 2's new tokens after turn 1's reply")
    ap.add_argument("--reply", type=int, default=8, help="tokens per reply")
    ap.add_argument("--chunk", type=int, default=1024, help="the prompt path's chunk (1: token by token)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)

    from strata.engine.cli import load_model
    from strata.engine.sampling import SamplerParams
    from strata.engine.scheduler import ConversationCache, Job, Scheduler, run_and_wait
    from strata.engine.tokenizer import Tokenizer

    p, model, load_s = load_model(a.pack, None, None, a.threads, "conversation_cache", a.chunk if a.chunk > 1 else 0)
    tok, g = Tokenizer.load(a.pack / "tokenizer.txt"), p.geometry
    rng = np.random.default_rng(0)
    turn1 = rng.integers(300, g.n_vocab, a.turn1).tolist()
    new = rng.integers(300, g.n_vocab, a.new).tolist()
    ctx = a.turn1 + a.reply + a.new + a.reply
    greedy = SamplerParams(temperature=0)
    replies = {}
    print(f"{a.pack.name}: {g.arch}, {g.n_layer} layers; turn 1 {a.turn1} tokens, turn 2 adds {a.reply} + {a.new}; "
          f"chunk {a.chunk}, --kv f16")
    for slots in (1, 0):
        sch = Scheduler(model, tok, max_context=ctx, kv="f16", chunk=a.chunk, max_queue=0,
                        cache=ConversationCache(slots, 1 << 40))
        try:
            j1 = run_and_wait(sch, Job(prompt=turn1, max_tokens=a.reply, params=greedy, ignore_eos=True))
            turn2 = turn1 + j1.result.tokens.tolist() + new
            t0 = time.perf_counter()
            j2 = run_and_wait(sch, Job(prompt=turn2, max_tokens=a.reply, params=greedy, ignore_eos=True))
            whole = time.perf_counter() - t0
        finally:
            sch.close()
        replies[slots] = j2.result.tokens.tolist()
        print(f"  cache {'on ' if slots else 'off'}: turn 2 ({len(turn2)} tokens) fed {len(turn2) - j2.resumed}, "
              f"prefill {j2.result.prefill_s:.3f} s, the whole request {whole:.3f} s")
    same = replies[1] == replies[0]
    print(f"  second replies {'identical' if same else 'DIFFER'}: {replies[1]}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
