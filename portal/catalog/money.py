"""Money: amounts as `Decimal` in the deployment's one currency (BATCHERY_CURRENCY).

A deployment bills in one currency: every price is in it (`Price.clean` refuses another) and every
budget is, so no sum ever adds two currencies. An amount keeps its full precision until it is
rounded, once, to the currency's minor unit (`to_minor_unit`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.core.exceptions import ValidationError

ZERO = Decimal(0)
MILLION = Decimal(1_000_000)
CURRENCY_CODE = re.compile(r"^[A-Z]{3}$")
MINOR_UNIT_DIGITS: dict[str, int] = {
    # ISO 4217 currencies whose minor unit is not a hundredth; every other code has two digits.
    **dict.fromkeys(["BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF"], 0),
    **dict.fromkeys(["UGX", "UYI", "VND", "VUV", "XAF", "XOF", "XPF"], 0),
    **dict.fromkeys(["BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"], 3),
    **dict.fromkeys(["CLF", "UYW"], 4),
}


def validate_currency(code: str) -> None:
    """An ISO 4217 code (three capital letters) and the deployment's own (BATCHERY_CURRENCY)."""
    if not CURRENCY_CODE.match(code or ""):
        raise ValidationError(f"{code!r} is not an ISO 4217 currency code (three capital letters, e.g. USD).")
    if code != settings.BATCHERY_CURRENCY:
        raise ValidationError(
            f"this deployment bills in {settings.BATCHERY_CURRENCY} (BATCHERY_CURRENCY); a price in {code} "
            "could not be added to the others."
        )


def to_minor_unit(amount: Decimal, currency: str) -> Decimal:
    """`amount` rounded half up to the currency's minor unit (cents for USD, yen for JPY)."""
    return amount.quantize(Decimal(1).scaleb(-MINOR_UNIT_DIGITS.get(currency, 2)), rounding=ROUND_HALF_UP)


@dataclass(frozen=True)
class Money:
    """An amount in a currency, as the API shows it: `{"amount": "12.34", "currency": "USD"}`."""

    amount: Decimal
    currency: str

    def as_dict(self) -> dict[str, str]:
        return {"amount": str(self.amount), "currency": self.currency}


def money(amount: Decimal) -> Money:
    """`amount` in the deployment's currency, rounded to its minor unit."""
    return Money(amount=to_minor_unit(amount, settings.BATCHERY_CURRENCY), currency=settings.BATCHERY_CURRENCY)
