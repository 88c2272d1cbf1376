"""The task suites, generated from small templates with fixed seeds: the same items on every machine and run
(seeds.py). Each suite has ITEMS items; `--items N` takes the first N. The harder suites are in
hard_suites.py."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import date

from corral.benchmarks.quality import hard_suites, many_tools_suite
from corral.benchmarks.quality.seeds import CURRENCIES, MONTHS
from corral.benchmarks.quality.seeds import ITEMS as ITEMS  # re-exported: callers count a suite's items here
from corral.benchmarks.quality.seeds import ordinal as _ordinal
from corral.benchmarks.quality.seeds import rng as _rng
from corral.benchmarks.quality.tasks import Field, Item, Task, closed_object

LABELS = ("positive", "negative", "neutral")


# -- 1. field extraction -------------------------------------------------------------------------------------
NAMES = ("Tomás Berg", "Priya Nair", "Kenji Watanabe", "Amara Okafor", "Lars Eriksen", "Sofia Rossi",
         "Mehmet Yilmaz", "Chloé Dubois", "Diego Herrera", "Hannah Schmidt", "Ravi Patel", "Olga Ivanova",
         "Fatima Zahra", "Liam O'Connor", "Mei Chen", "Jonas Lind", "Aisha Bello", "Noah Fischer", "Elena Petrova",
         "Marco Bianchi")
CITIES = ("Lisbon", "Mumbai", "Osaka", "Lagos", "Bergen", "Turin", "Izmir", "Lyon", "Bogotá", "Hamburg", "Pune",
          "Kazan", "Rabat", "Cork", "Chengdu", "Uppsala", "Accra", "Graz", "Sofia", "Naples")
PERSON_TEMPLATES = (
    "{name} is {age} and lives in {city}.",
    "My neighbour {name}, {age}, moved to {city} last year.",
    "Yesterday {name} (age {age}) flew home to {city}.",
    "{name}, a {age}-year-old teacher from {city}, won the prize.",
    "In {city}, {name} celebrated turning {age} with friends.",
    "Our new colleague {name} is {age} years old and commutes from {city}.",
)


def person() -> Task:
    rng = _rng("person")
    names, cities = list(NAMES), list(CITIES)
    rng.shuffle(names)
    rng.shuffle(cities)
    items = []
    for i in range(ITEMS):
        truth = {"name": names[i], "age": rng.randint(19, 88), "city": cities[i]}
        items.append(Item(f"person-{i:02d}", PERSON_TEMPLATES[i % len(PERSON_TEMPLATES)].format(**truth), truth))
    return Task(
        "person", "json", "field extraction: a person's name, age and city from one sentence",
        "Extract the person's name, age and city from the sentence as JSON.", "Sentence", "JSON",
        (Field("name"), Field("age", "number"), Field("city")),
        # A full name, as the items have: a first-name-only example made the model drop surnames (measured).
        Item("example", "Alice Moreau is 31 and lives in Oslo.", {"name": "Alice Moreau", "age": 31, "city": "Oslo"}),
        tuple(items),
        closed_object({"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}),
    )


# -- 2. normalisation ----------------------------------------------------------------------------------------
DATE_STYLES: tuple[Callable[[date], str], ...] = (
    lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",
    lambda d: f"{d.day} {MONTHS[d.month - 1]} {d.year}",
    lambda d: f"{MONTHS[d.month - 1][:3]} {d.day} {d.year}",
    lambda d: f"the {d.day}{_ordinal(d.day)} of {MONTHS[d.month - 1]}, {d.year}",
)
AMOUNT_STYLES = {  # currency -> how a sentence writes the amount
    "USD": lambda a: f"${a:,.2f}",
    "EUR": lambda a: f"€{a:,.2f}",
    "GBP": lambda a: f"£{a:,.2f}",
    "JPY": lambda a: f"{a:,.0f} yen",
}
NORMALISE_TEMPLATES = (
    "Invoice {n} was issued on {date} for {amount}.",
    "On {date} we paid {amount} to the supplier.",
    "The refund of {amount} was processed on {date}.",
    "{date}: membership renewed, {amount} charged to the card.",
)


def normalise() -> Task:
    rng = _rng("normalise")
    items = []
    for i in range(ITEMS):
        when = date(rng.randint(2015, 2025), rng.randint(1, 12), rng.randint(1, 28))
        currency = CURRENCIES[i % len(CURRENCIES)]
        amount = float(rng.randint(5, 90) * 100) if currency == "JPY" else rng.randint(150, 250000) / 100
        text = NORMALISE_TEMPLATES[i % len(NORMALISE_TEMPLATES)].format(
            n=rng.randint(1000, 9999), date=DATE_STYLES[(i // 2) % len(DATE_STYLES)](when),
            amount=AMOUNT_STYLES[currency](amount))
        items.append(Item(f"normalise-{i:02d}", text,
                          {"date": when.isoformat(), "amount": amount, "currency": currency}))
    return Task(
        "normalise", "json", "normalisation: a date to ISO 8601, an amount to a number and its currency code",
        "Write the date as YYYY-MM-DD, the amount as a number and the currency as its ISO code, as JSON.",
        "Text", "JSON", (Field("date"), Field("amount", "number"), Field("currency", "label")),
        Item("example", "The invoice dated 5 January 2022 came to $1,120.00.",
             {"date": "2022-01-05", "amount": 1120.0, "currency": "USD"}),
        tuple(items),
        closed_object({"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}, "amount": {"type": "number"},
                       "currency": {"enum": list(CURRENCIES)}}),
    )


# -- 3. classification ---------------------------------------------------------------------------------------
PRODUCTS = ("kettle", "headphones", "backpack", "phone case", "desk lamp", "coffee grinder", "keyboard", "tent",
            "blender", "umbrella")
REVIEWS = {
    "positive": ("I love this {p}; it works perfectly.", "Great {p}, I would buy it again!",
                 "The {p} exceeded my expectations and arrived early.", "Best {p} I have owned, excellent quality."),
    "negative": ("The {p} broke after two days. Very disappointed.", "Terrible {p}, a complete waste of money.",
                 "I want a refund: this {p} does not work at all.", "The {p} is flimsy and support never answered."),
    "neutral": ("The {p} arrived on Tuesday in a brown box.", "It is a {p}. It comes in black and grey.",
                "I bought the {p} for my brother's flat.", "The {p} is the same model as the one in the shop."),
}


def _reviews() -> list[tuple[str, str]]:
    rng = _rng("sentiment")
    out = []
    for i in range(ITEMS):
        label = LABELS[i % len(LABELS)]
        out.append((rng.choice(REVIEWS[label]).format(p=rng.choice(PRODUCTS)), label))
    return out


SENTIMENT_EXAMPLE = "The blanket is soft and warm, I am very happy with it."


def sentiment() -> Task:
    items = tuple(Item(f"sentiment-{i:02d}", text, {"sentiment": label})
                  for i, (text, label) in enumerate(_reviews()))
    return Task(
        "sentiment", "json", "classification into an enum inside a JSON object",
        "Classify the sentiment of the review as positive, negative or neutral, as JSON.", "Review", "JSON",
        (Field("sentiment", "label"),), Item("example", SENTIMENT_EXAMPLE, {"sentiment": "positive"}), items,
        closed_object({"sentiment": {"enum": list(LABELS)}}), LABELS,
    )


def sentiment_choice() -> Task:
    items = tuple(Item(f"sentiment-{i:02d}", text, label) for i, (text, label) in enumerate(_reviews()))
    return Task(
        "sentiment_choice", "choice", "the same classification as a bare label (structured_outputs.choice)",
        "Classify the sentiment of the review as positive, negative or neutral.", "Review", "Sentiment",
        (Field("label", "label"),), Item("example", SENTIMENT_EXAMPLE, "positive"), items,
        {"type": "string", "enum": list(LABELS)}, LABELS,
    )


# -- 4. nested records with arrays ---------------------------------------------------------------------------
GOODS = {"notebook": 3.5, "pen": 1.25, "stapler": 8.0, "mug": 6.5, "lamp": 24.0, "folder": 2.0, "cable": 9.99,
         "charger": 19.0, "towel": 7.5, "candle": 4.25}
ORDER_TEMPLATES = (
    "Order from {customer}: {goods}. Total: ${total}.",
    "{customer} ordered {goods} for a total of ${total}.",
    "Please ship {goods} to {customer}; the total comes to ${total}.",
)


def _goods_text(lines: list[dict[str, object]]) -> str:
    words = [f"{line['qty']} {line['name']}{'s' if line['qty'] != 1 else ''}" for line in lines]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def order() -> Task:
    rng = _rng("order")
    customers = list(NAMES)
    rng.shuffle(customers)
    items = []
    for i in range(ITEMS):
        names = rng.sample(sorted(GOODS), rng.randint(1, 3))
        lines: list[dict[str, object]] = [{"name": n, "qty": rng.randint(1, 5)} for n in names]
        total = round(sum(GOODS[str(line["name"])] * int(str(line["qty"])) for line in lines), 2)
        text = ORDER_TEMPLATES[i % len(ORDER_TEMPLATES)].format(customer=customers[i], goods=_goods_text(lines),
                                                                total=f"{total:.2f}")
        items.append(Item(f"order-{i:02d}", text, {"customer": customers[i], "items": lines, "total": total}))
    line_schema = closed_object({"name": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}})
    return Task(
        "order", "json", "a nested record: a customer, an array of {name, qty} items and a total",
        "Extract the order as JSON: the customer, the items (name and quantity) and the total.", "Text", "JSON",
        (Field("customer"), Field("items", "items"), Field("total", "number")),
        Item("example", "Order from Alice Moreau: 2 sponges and 1 broom. Total: $13.00.",
             {"customer": "Alice Moreau", "items": [{"name": "sponge", "qty": 2}, {"name": "broom", "qty": 1}],
              "total": 13.0}),
        tuple(items),
        # No maxItems: a user's schema has none, and this is where a base model repeats items.
        closed_object({"customer": {"type": "string"}, "items": {"type": "array", "items": line_schema,
                                                                  "minItems": 1}, "total": {"type": "number"}}),
    )


# -- 5. tool-call arguments ----------------------------------------------------------------------------------
TOOLS = (
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": closed_object({"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}})}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Reserve a table at a restaurant.",
        "parameters": closed_object({"restaurant": {"type": "string"}, "people": {"type": "integer", "minimum": 1},
                                     "time": {"type": "string", "pattern": r"^\d{2}:\d{2}$"}})}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money between currencies.",
        "parameters": closed_object({"amount": {"type": "number"}, "from": {"enum": list(CURRENCIES)},
                                     "to": {"enum": list(CURRENCIES)}})}},
)
RESTAURANTS = ("Luigi's", "The Blue Door", "Sakura", "Casa Lola", "Le Petit Zinc", "Golden Dragon")
TOOL_REQUESTS = {
    "get_weather": ("What's the weather in {city} right now, in {unit}?",
                    "Is it cold in {city}? Give me the temperature in {unit}."),
    "book_table": ("Book a table for {people} at {restaurant} at {time}.",
                   "Can you reserve {restaurant} for {people} people at {time} tonight?"),
    "convert_currency": ("How much is {amount:g} {from_} in {to}?", "Convert {amount:g} {from_} to {to}, please."),
}


def tool_call() -> Task:
    rng = _rng("tool_call")
    items = []
    for i in range(ITEMS):
        name = ("get_weather", "book_table", "convert_currency")[i % 3]
        if name == "get_weather":
            args: dict[str, object] = {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}
            fill = dict(args)
        elif name == "book_table":
            args = {"restaurant": rng.choice(RESTAURANTS), "people": rng.randint(2, 8),
                    "time": f"{rng.randint(17, 21)}:{rng.choice(['00', '15', '30', '45'])}"}
            fill = dict(args)
        else:
            source, target = rng.sample(CURRENCIES, 2)
            args = {"amount": float(rng.randint(2, 400) * 5), "from": source, "to": target}
            fill = {"amount": args["amount"], "from_": source, "to": target}
        text = TOOL_REQUESTS[name][(i // 3) % 2].format(**fill)
        items.append(Item(f"tool-{i:02d}", text, {"name": name, "arguments": args}))
    return Task(
        "tool_call", "tool", "tool-call argument filling: pick the function, fill its arguments (tools, a call "
        "required)", "", "Request", "Call",
        (Field("name", "label"), Field("city"), Field("unit", "label"), Field("restaurant"),
         Field("people", "number"), Field("time"), Field("amount", "number"), Field("from", "label"),
         Field("to", "label")),
        Item("example", "What's the weather in Oslo, in celsius?",
             {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}),
        tuple(items), tools=TOOLS,
    )


# -- 6. reasoning, then the answer ---------------------------------------------------------------------------
PEOPLE = ("Ana", "Ben", "Chidi", "Dana", "Emil", "Farah", "Gus", "Hiro", "Ines", "Jamal")
THINGS = ("apples", "stickers", "marbles", "cookies", "stamps")


def _problem(rng: random.Random, i: int) -> tuple[str, str, int]:
    """A small word problem (two steps at most), a reference reasoning and the answer."""
    who, what = rng.choice(PEOPLE), rng.choice(THINGS)
    kind = i % 5
    if kind == 0:
        a, b, c = rng.randint(5, 30), rng.randint(2, 20), rng.randint(1, 5)
        return (f"{who} has {a} {what}, buys {b} more and gives {c} to a friend. How many {what} does {who} "
                f"have now?", f"{a} + {b} = {a + b}; {a + b} - {c} = {a + b - c}.", a + b - c)
    if kind == 1:
        a, b = rng.randint(3, 12), rng.randint(2, 9)
        return (f"A box holds {a} {what}. How many {what} are in {b} boxes?", f"{b} * {a} = {a * b}.", a * b)
    if kind == 2:
        a, b, c = rng.randint(5, 20), rng.randint(2, 7), rng.randint(3, 15)
        return (f"{who} reads {a} pages a day for {b} days, then {c} more pages. How many pages did {who} read?",
                f"{a} * {b} = {a * b}; {a * b} + {c} = {a * b + c}.", a * b + c)
    if kind == 3:
        groups, each = rng.randint(2, 8), rng.randint(3, 9)
        return (f"{groups * each} students are split equally into {groups} groups. How many students are in "
                f"each group?", f"{groups * each} / {groups} = {each}.", each)
    a, b, c = rng.randint(40, 100), rng.randint(5, 20), rng.randint(5, 15)
    return (f"{who} had ${a}, spent ${b} on lunch and ${c} on a book. How many dollars are left?",
            f"{a} - {b} = {a - b}; {a - b} - {c} = {a - b - c}.", a - b - c)


EXAMPLE_PROBLEM = ("Tom has 3 bags with 12 apples each and eats 7 apples. How many apples are left?",
                   "3 * 12 = 36; 36 - 7 = 29.", 29)


def _arithmetic(name: str, reasoning: bool) -> Task:
    rng = _rng("arithmetic")  # both tasks ask the same problems: the reasoning field is the only difference
    items = []
    for i in range(ITEMS):
        text, why, answer = _problem(rng, i)
        truth = {"reasoning": why, "answer": answer} if reasoning else {"answer": answer}
        items.append(Item(f"arithmetic-{i:02d}", text, truth))
    text, why, answer = EXAMPLE_PROBLEM
    example = {"reasoning": why, "answer": answer} if reasoning else {"answer": answer}
    properties: dict[str, object] = {"answer": {"type": "integer"}}
    if reasoning:
        properties = {"reasoning": {"type": "string"}, **properties}
    return Task(
        name, "json", "a word problem, the reasoning written before the answer (GSM8K style)" if reasoning else
        "the same word problems, the answer alone (no reasoning field)",
        "Solve the problem. Write the short reasoning, then the answer, as JSON." if reasoning else
        "Solve the problem. Write the answer as JSON.", "Problem", "JSON", (Field("answer", "number"),),
        Item("example", text, example), tuple(items), closed_object(properties),
    )


def arithmetic_reasoning() -> Task:
    return _arithmetic("arithmetic_reasoning", True)


def arithmetic() -> Task:
    return _arithmetic("arithmetic", False)


SUITES: dict[str, Callable[[], Task]] = {
    "person": person, "normalise": normalise, "sentiment": sentiment, "sentiment_choice": sentiment_choice,
    "order": order, "tool_call": tool_call, "arithmetic_reasoning": arithmetic_reasoning, "arithmetic": arithmetic,
    # Harder ones, for an instruct model, which answers the above unconstrained with few misses (hard_suites.py).
    "contact_card": hard_suites.contact_card, "records": hard_suites.records,
    "normalise_hard": hard_suites.normalise_hard, "tool_choice_many": many_tools_suite.tool_choice_many,
}


def load_tasks(names: list[str] | None = None, items: int | None = None) -> list[Task]:
    """The named suites (all when None), in SUITES' order, each cut to its first `items` items."""
    wanted = names if names else list(SUITES)
    unknown = [n for n in wanted if n not in SUITES]
    if unknown:
        raise ValueError(f"--tasks: unknown task {', '.join(unknown)}; the tasks are {', '.join(SUITES)}")
    if items is not None and items < 1:
        raise ValueError(f"--items must be positive, got {items}")
    return [SUITES[n]().with_items(items) for n in SUITES if n in wanted]
