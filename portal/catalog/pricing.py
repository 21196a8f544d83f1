"""Which price applies: the prices in force for a model, one of its adapters and a GPU class on a day.

`PriceBook` reads the prices of the models it is asked about once, so that pricing a page of ledger
lines costs one query, not one a line.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable

from portal.catalog.models import Price


class PriceBook:
    """The prices of some models, every date's, resolved in memory."""

    def __init__(self, *, model_ids: Iterable[int]) -> None:
        self._prices: dict[int, list[Price]] = defaultdict(list)
        for price in Price.objects.filter(model_id__in=set(model_ids)):
            self._prices[price.model_id].append(price)

    def price(self, *, model_id: int, adapter_id: int | None, gpu_class_id: int | None, day: dt.date) -> Price | None:
        """The price in force on `day` for the model (run with the adapter `adapter_id`, None: bare) on the GPU
        class: an adapter's own price beats the model's, a class's own beats one for any class, and of those
        alike the newest in force wins. None: the model has no price in force that day."""
        candidates = [
            price
            for price in self._prices.get(model_id, ())
            if price.effective_from <= day
            and price.adapter_id in (None, adapter_id)
            and price.gpu_class_id in (None, gpu_class_id)
        ]
        if not candidates:
            return None
        return max(
            candidates,
            key=lambda price: (price.adapter_id is not None, price.gpu_class_id is not None, price.effective_from),
        )
