"""The official `openai` package against `pdflash serve`: list models, stream a chat, a completion.

    pdflash serve &                                            # in one shell (built-in model, port 8000)
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
    python examples/openai_client.py                           # no server? one starts in-process on a free port

pdflash accepts the OpenAI fields model, prompt/messages, max_tokens (or max_completion_tokens),
temperature, top_p, stop, seed, stream, stream_options and n=1; `top_k` and `stop_token_ids` go
in `extra_body`. Every response also carries pdflash's per-request `metrics`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import openai


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Talk to a pdflash server with the openai package.")
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1 (default: start a server in-process)")
    p.add_argument("--prompt", default="Write a function that reverses a string.")
    p.add_argument("--max-tokens", type=int, default=48)
    return p.parse_args()


@contextlib.contextmanager
def local_server():
    """The built-in model behind a real HTTP server on a free loopback port, in a thread."""
    from pdflash import AsyncEngine
    from pdflash.bundled import default_drafter, default_target
    from pdflash.server import BackgroundServer, ServerSettings, create_app

    target = default_target()
    engine = AsyncEngine.from_pretrained(target, default_drafter(target))
    with BackgroundServer(create_app(engine, ServerSettings(model_name=target.name))) as server:
        print(f"(started a pdflash server on {server.url})", file=sys.stderr)
        yield server.url + "/v1"


def main(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as stack:
        base_url = args.base_url or stack.enter_context(local_server())
        client = openai.OpenAI(base_url=base_url, api_key="pdflash-needs-no-key")
        model = client.models.list().data[0].id
        print(f"model: {model}\n\n--- chat (streamed) ---")

        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": args.prompt}],
            max_tokens=args.max_tokens,
            temperature=0.7,
            seed=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage:
                print(f"\n[usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion]")

        print("\n--- completion (whole) ---")
        completion = client.completions.create(
            model=model, prompt="def fibonacci(n):", max_tokens=args.max_tokens, extra_body={"top_k": 40}
        )
        print(completion.choices[0].text)
        metrics = completion.model_extra["metrics"]
        print(
            f"[finish: {completion.choices[0].finish_reason}, {metrics['tokens_per_second']:.1f} tokens/s, "
            f"mean acceptance {metrics['mean_acceptance_length']:.2f}]"
        )


if __name__ == "__main__":
    main(parse_args())
