"""The API's clients of the inference server: one per event loop, closed with it when asked."""

from __future__ import annotations

import anyio

from api.services import inference
from api.settings import Settings


def test_close_clients_closes_this_loops_client_and_the_next_use_opens_a_new_one() -> None:
    settings = Settings(inference_url="http://127.0.0.1:9/v1")

    async def main() -> None:
        first = inference._client(settings)
        assert inference._client(settings) is first  # one per loop, reused
        await inference.close_clients()
        assert first.is_closed
        second = inference._client(settings)
        assert second is not first and not second.is_closed
        await inference.close_clients()

    anyio.run(main)


def test_close_clients_in_a_loop_that_opened_none_does_nothing() -> None:
    anyio.run(inference.close_clients)
