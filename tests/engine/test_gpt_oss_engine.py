"""The engine serves gpt-oss unchanged: DFlash, offloaded MXFP4 experts, the 2-D scheduler."""

import anyio
import pytest

from pdflash.engine.async_engine import AsyncEngine
from pdflash.kernels import mxfp4_expert_nbytes
from pdflash.sampling import SamplingParams
from pdflash.target.generate import generate_autoregressive
from pdflash.target.loader import load_target
from pdflash.target.tiny import write_tiny_drafter
from pdflash.target.tiny_gpt_oss import write_tiny_gpt_oss

PROMPTS = [[5, 9, 14, 200, 31, 7, 8, 9, 10, 11], list(range(40, 63)), [260, 3, 3, 3]]
GREEDY = SamplingParams(max_tokens=20)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))
    drafter = write_tiny_drafter(
        tmp_path_factory.mktemp("drafter"),
        target,
        block_size=8,
        layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True,
        sliding_window=8,
    )
    return target, drafter


async def generate_all(engine, prompts):
    results = [None] * len(prompts)

    async def one(i, prompt):
        ids = []
        async for out in engine.generate(prompt, GREEDY):
            ids += out.token_ids
        results[i] = ids

    async with anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            tg.start_soon(one, i, prompt)
    return results


@pytest.mark.asyncio
@pytest.mark.parametrize("two_dimensional", [False, True], ids=["token-only", "2-D"])
async def test_concurrent_requests_offloaded_equal_plain_decoding(pair, two_dimensional):
    target, drafter = pair
    model = load_target(target).model
    expected = [list(generate_autoregressive(model, p, GREEDY).token_ids) for p in PROMPTS]
    block_union_bytes = 4 * 8 * mxfp4_expert_nbytes(64, 32)  # every expert of the 4 layers: 112,640 bytes
    budgets = (  # about one block's union per tick: three live sequences cannot all verify at once
        dict(
            verify_token_budget=16,
            verify_token_cap=32,
            verify_byte_budget=block_union_bytes,
            verify_byte_cap=2 * block_union_bytes,
        )
        if two_dimensional
        else {}
    )
    offload = {"expert_cache_fraction": 0.1, "link_gbps": 16.0}
    async with AsyncEngine.from_pretrained(target, drafter, offload=offload, max_num_seqs=4, **budgets) as engine:
        got = await generate_all(engine, PROMPTS)
        stats = engine.stats()
    assert got == expected
    assert stats.provider["expert_bytes_fetched"] > 0 and stats.provider["evictions"] > 0
