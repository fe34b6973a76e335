"""Usage and cost per UTC day, key and model, for the admin console's charts.

Cost is tokens times the model's configured `pricing` (US dollars per million input and output
tokens) at the time of the query; cache hits are recorded with zero tokens, so they cost nothing.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from kvik.gateway.model_config import PricingConfig
from kvik.gateway.storage.database import Database

DAY_S = 86_400
# Whole days since the epoch; PostgreSQL's CAST rounds, so it floors explicitly.
DAY_EXPRESSION = {"sqlite": "CAST(created_at / 86400 AS INTEGER)", "postgresql": "FLOOR(created_at / 86400)"}


def daily_usage(db: Database, pricing: dict[str, PricingConfig], *, since: float | None = None,
                until: float | None = None, key_id: str | None = None, model: str | None = None,
                ) -> list[dict[str, Any]]:
    day = DAY_EXPRESSION[db.dialect]
    conditions, params = [], []
    for clause, value in (("created_at >= ?", since), ("created_at < ?", until), ("key_id = ?", key_id),
                          ("model = ?", model)):
        if value is not None:
            conditions.append(clause)
            params.append(value)
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    rows = db.fetchall(
        f"SELECT {day} AS day, key_id, model, COUNT(*) AS requests, "
        f"SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors, SUM(cached) AS cached, "
        f"SUM(prompt_tokens) AS prompt_tokens, SUM(completion_tokens) AS completion_tokens "
        f"FROM usage_records{where} GROUP BY {day}, key_id, model ORDER BY {day}, key_id, model", params)
    out = []
    for row in rows:
        prompt, completion = int(row["prompt_tokens"] or 0), int(row["completion_tokens"] or 0)
        price = pricing.get(row["model"]) or PricingConfig()
        cost = (prompt * price.input_per_million + completion * price.output_per_million) / 1e6
        out.append({
            "day": dt.datetime.fromtimestamp(int(row["day"]) * DAY_S, dt.timezone.utc).date().isoformat(),
            "key_id": row["key_id"], "model": row["model"], "requests": int(row["requests"]),
            "errors": int(row["errors"] or 0), "cached": int(row["cached"] or 0), "prompt_tokens": prompt,
            "completion_tokens": completion, "total_tokens": prompt + completion, "cost_usd": round(cost, 6),
        })
    return out
