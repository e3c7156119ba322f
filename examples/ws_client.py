"""Several generations at once over one websocket (`/ws`), with live per-request numbers.

    pdflash serve &                                      # in one shell (built-in model, port 8000)
    python examples/ws_client.py --url ws://127.0.0.1:8000/ws
    python examples/ws_client.py                         # no server? one starts in-process on a free port
    python examples/ws_client.py --cancel 1              # cancel generation 1 after its first delta

Protocol: docs/websocket.md. Client messages: start, cancel. Server messages: delta, done,
error, stats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys

from websockets.asyncio.client import connect

PROMPTS = ["def quicksort(xs):", "The capital of France is", "Once upon a time"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run several generations concurrently on one pdflash websocket.")
    p.add_argument("--url", help="e.g. ws://127.0.0.1:8000/ws (default: start a server in-process)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: three built-in ones)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cancel", type=int, default=None, metavar="N", help="cancel generation N after its first delta")
    return p.parse_args()


@contextlib.contextmanager
def local_server():
    """The built-in model behind a real server on a free loopback port, in a thread."""
    from pdflash import AsyncEngine
    from pdflash.bundled import default_drafter, default_target
    from pdflash.server import BackgroundServer, ServerSettings, create_app

    target = default_target()
    engine = AsyncEngine.from_pretrained(target, default_drafter(target))
    with BackgroundServer(create_app(engine, ServerSettings(model_name=target.name))) as server:
        print(f"(started a pdflash server on {server.url})", file=sys.stderr)
        yield server.ws_url


async def run(url: str, prompts: list[str], max_tokens: int, cancel: int | None) -> None:
    async with connect(url) as ws:
        for i, prompt in enumerate(prompts):
            start = {"type": "start", "id": i, "prompt": prompt, "params": {"max_tokens": max_tokens}}
            await ws.send(json.dumps(start))
        texts = {i: "" for i in range(len(prompts))}
        pending = set(texts)
        while pending:
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                texts[msg["id"]] += msg["text"]
                print(
                    f"[{msg['id']}] +{len(msg['token_ids'])} tokens, acceptance {msg['acceptance_lengths']}, "
                    f"expert bytes {msg['expert_bytes']:,}: {msg['text']!r}"
                )
                if msg["id"] == cancel:
                    await ws.send(json.dumps({"type": "cancel", "id": cancel}))
                    cancel = None
            elif msg["type"] == "done":
                m = msg["metrics"]
                print(
                    f"[{msg['id']}] done ({msg['finish_reason']}): {m.get('generated_tokens', 0)} tokens, "
                    f"{m.get('tokens_per_second', 0):.1f} tokens/s"
                )
                pending.discard(msg["id"])
            elif msg["type"] == "error":
                print(f"[{msg.get('id')}] error {msg['code']}: {msg['message']}")
                pending.discard(msg.get("id"))
            elif msg["type"] == "stats":
                print(
                    f"[engine] live {msg['live_sequences']}, {msg['tokens_per_second']:.1f} tokens/s, "
                    f"projected expert bytes {msg['expert_bytes_projected']:,}, "
                    f"fetched {msg['expert_bytes_fetched']}, hit rate {msg['expert_cache_hit_rate']}"
                )
    print()
    for i, prompt in enumerate(prompts):
        print(f"{i}: {prompt!r} -> {texts[i]!r}")


def main(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server())
        asyncio.run(run(url, args.prompt or PROMPTS, args.max_tokens, args.cancel))


if __name__ == "__main__":
    main(parse_args())
