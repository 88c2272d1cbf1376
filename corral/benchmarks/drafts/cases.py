"""Extraction requests whose answers copy from an e-mail-sized text: a customer order written as an e-mail, the
record to extract as a JSON Schema, and the values the answer must hold (drawn from a seeded generator)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

FIRST = ["Margarethe", "Tomás", "Ingrid", "Oluwaseun", "Priyanka", "Henrik", "Yuki", "Aleksandra", "Matteo", "Zainab"]
LAST = ["Okonkwo-Lindqvist", "Berg", "Van der Meulen", "Castellanos", "Nakamura", "Sørensen", "Abernathy", "Kowalczyk"]
COMPANIES = ["Northwind Traders AB", "Blue Harbour Logistics Ltd", "Fjordline Medical GmbH", "Casa Verde S.L.",
             "Kestrel Analytics Inc.", "Polar Bakeries Oy"]
STREETS = ["Storgatan 14, 114 55 Stockholm, Sweden", "221 Baker Street, London NW1 6XE, United Kingdom",
           "Hauptstraße 7, 10115 Berlin, Germany", "Calle de Alcalá 48, 28014 Madrid, Spain",
           "1600 Amphitheatre Parkway, Mountain View, CA 94043, USA", "Mannerheimintie 12, 00100 Helsinki, Finland"]
PARTS = ["XK-4471-B hydraulic coupling", "ZR-2210 stainless hinge", "MX-0907 thermal sensor", "QP-5563 gasket kit",
         "LT-8120 LED driver board"]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "phone": {"type": "string"},
        "company": {"type": "string"},
        "address": {"type": "string"},
        "order_id": {"type": "string"},
        "date": {"type": "string"},
        "part": {"type": "string"},
        "units": {"type": "integer"},
    },
    "required": ["name", "email", "phone", "company", "address", "order_id", "date", "part", "units"],
    "additionalProperties": False,
}
INSTRUCTION = ("Extract the customer's order from the e-mail below as JSON with the fields name, email, phone, "
               "company, address, order_id, date (YYYY-MM-DD), part and units. Copy the values exactly as written.")


FREE_INSTRUCTION = "Reply to the customer's e-mail below: confirm every detail of the order, quoting it back."
# The plain task: text on a topic, nothing in the prompt to copy.
TOPICS = ["how bread rises", "why the sky is blue", "the history of the bicycle", "how tides work",
          "what a compiler does", "how bees make honey", "why leaves change colour", "how a lighthouse works"]


@dataclass(frozen=True)
class ExtractionCase:
    prompt: str
    expected: dict[str, Any]
    free_prompt: str  # the same e-mail for the free-text task (answered in words, no schema)
    plain_prompt: str = ""  # the plain task's: a topic, no e-mail


def extraction_cases(count: int, seed: int = 7) -> list[ExtractionCase]:
    """`count` e-mails (~180 words each), each with the record its answer should be."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        name = f"{first} {last}"
        handle = f"{first[0]}.{last.split()[-1]}".lower().replace("ø", "o").replace("á", "a")
        company = rng.choice(COMPANIES)
        domain = company.split()[0].lower() + "-" + company.split()[1].lower().strip(".")
        record = {
            "name": name,
            "email": f"{handle}@{domain}.example.com",
            "phone": f"+{rng.randint(30, 49)} {rng.randint(10, 99)} {rng.randint(100, 999)} {rng.randint(10, 99)} "
                     f"{rng.randint(10, 99)}",
            "company": company,
            "address": rng.choice(STREETS),
            "order_id": f"A-{rng.randint(10000, 99999)}",
            "date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            "part": rng.choice(PARTS),
            "units": rng.randint(2, 900),
        }
        email = (
            f"Subject: New order {record['order_id']}\n\nHi team,\n\nplease register the order below and set up the "
            f"customer account before Friday. The customer is {name} of {company}; she asked us to send every "
            f"confirmation to {record['email']} and to call {record['phone']} if anything in the shipment is "
            f"unclear. Deliveries go to {record['address']}, loading dock at the back, weekdays between 8 and 16.\n\n"
            f"The order {record['order_id']} was signed on {record['date']} and covers {record['units']} units of "
            f"the {record['part']}, to be shipped in two batches. Payment terms are 30 days net as usual; the "
            f"price list from March applies, and the volume discount was agreed on the phone last week.\n\n"
            f"{first} also mentioned that their warehouse moves next spring, so please note that the address may "
            f"change then. If anything is missing, reply to this thread.\n\nThanks,\nJonas (sales, case {i + 1})"
        )
        plain = f"Explain {TOPICS[i % len(TOPICS)]} in a few paragraphs."
        cases.append(ExtractionCase(f"{INSTRUCTION}\n\n{email}", record, f"{FREE_INSTRUCTION}\n\n{email}", plain))
    return cases
