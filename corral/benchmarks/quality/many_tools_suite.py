"""`corral bench quality`'s tool_choice_many suite: one call among twelve tools in look-alike pairs (the other
harder suites are in hard_suites.py)."""

from __future__ import annotations

import random
from datetime import date
from typing import Any

from corral.benchmarks.quality.hard_suites import CLOCK, ISO_DATE, WORDS, random_digits, random_letters
from corral.benchmarks.quality.seeds import CURRENCIES, ITEMS, MONTHS, ordinal, rng
from corral.benchmarks.quality.tasks import Compare, Field, Item, Task

# -- 4. one call among many tools -----------------------------------------------------------------------------
MONEY = (*CURRENCIES, "CHF", "SEK")
MONEY_WORDS = {"USD": "US dollars", "EUR": "euros", "GBP": "British pounds", "JPY": "Japanese yen",
               "CHF": "Swiss francs", "SEK": "Swedish kronor"}


def _tool(name: str, description: str, properties: dict[str, Any], required: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required), "additionalProperties": False}}}


UNIT = {"enum": ["celsius", "fahrenheit"]}
DATE = {"type": "string", "pattern": ISO_DATE, "description": "YYYY-MM-DD"}
TIME = {"type": "string", "pattern": CLOCK, "description": "HH:MM, 24-hour"}
MANY_TOOLS = (
    _tool("get_weather", "Weather in a city: the conditions right now.",
          {"city": {"type": "string"}, "unit": UNIT}, ("city",)),
    _tool("get_forecast", "Weather in a city: the forecast for the coming days.",
          {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 10}, "unit": UNIT},
          ("city", "days")),
    _tool("convert_currency", "Convert an amount of money from one currency to another.",
          {"amount": {"type": "number", "exclusiveMinimum": 0}, "from": {"enum": list(MONEY)},
           "to": {"enum": list(MONEY)}}, ("amount", "from", "to")),
    _tool("get_exchange_rate", "The current exchange rate between two currencies.",
          {"base": {"enum": list(MONEY)}, "quote": {"enum": list(MONEY)}}, ("base", "quote")),
    _tool("book_table", "Reserve a table at a restaurant.",
          {"restaurant": {"type": "string"}, "people": {"type": "integer", "minimum": 1, "maximum": 20},
           "date": DATE, "time": TIME}, ("restaurant", "people", "date", "time")),
    _tool("cancel_booking", "Cancel a restaurant reservation by its booking reference.",
          {"booking_id": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{4}$"},
           "reason": {"enum": ["change_of_plans", "illness", "other"]}}, ("booking_id",)),
    _tool("create_reminder", "Remind the user of something on a date, optionally at a time.",
          {"text": {"type": "string"}, "date": DATE, "time": TIME}, ("text", "date")),
    _tool("set_timer", "Start a countdown timer for a number of minutes.",
          {"minutes": {"type": "integer", "minimum": 1, "maximum": 1440}, "label": {"type": "string"}},
          ("minutes",)),
    _tool("send_email", "Send an e-mail message.",
          {"recipient": {"type": "string", "pattern": r"^[^@\s]+@[^@\s]+\.[a-z]+$"}, "subject": {"type": "string"},
           "body": {"type": "string"}}, ("recipient", "subject")),
    _tool("search_flights", "Search for flights between two airports on a date.",
          {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "destination": {"type": "string", "pattern": "^[A-Z]{3}$"}, "date": DATE,
           "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
           "cabin": {"enum": ["economy", "premium_economy", "business", "first"]}},
          ("origin", "destination", "date")),
    _tool("get_stock_price", "The latest price of a company's shares by its ticker symbol.",
          {"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
           "exchange": {"enum": ["NASDAQ", "NYSE", "LSE", "XETRA"]}}, ("symbol",)),
    _tool("track_package", "Where a parcel is, by its tracking number.",
          {"tracking_number": {"type": "string", "pattern": "^[A-Z0-9]{10,22}$"},
           "carrier": {"enum": ["dhl", "ups", "fedex", "postnl"]}}, ("tracking_number",)),
)
# How each argument is scored, whichever tool has it.
ARGUMENTS: dict[str, Compare] = {
    "city": "text", "unit": "label", "days": "number", "restaurant": "text", "people": "number", "date": "text",
    "time": "text", "booking_id": "label", "reason": "label", "amount": "number", "from": "label", "to": "label",
    "base": "label", "quote": "label", "recipient": "label", "subject": "text", "body": "text", "text": "text",
    "minutes": "number", "label": "text", "origin": "label", "destination": "label", "passengers": "number",
    "cabin": "label", "symbol": "label", "exchange": "label", "tracking_number": "label", "carrier": "label"}
WEATHER_CITIES = ("Bergen", "Turin", "Lyon", "Osaka", "Cork", "Graz", "Kazan", "Accra")
RESTAURANTS = ("Luigi's", "The Blue Door", "Sakura", "Casa Lola", "Le Petit Zinc", "Golden Dragon")
REMINDERS = ("renew the passport", "call the dentist", "water the plants", "pay the electricity bill",
             "book the car service", "send Mum a birthday card")
SPANS_OF_TIME = (("an hour and a half", 90), ("three quarters of an hour", 45), ("an hour and a quarter", 75),
                 ("two hours", 120))
MAILBOXES = (("Anna", "anna.berg@example.com"), ("Raj", "raj.mehta@example.org"), ("the team", "team@example.net"),
             ("Dr Okoye", "c.okoye@example.com"))
SUBJECTS = ("Q3 figures", "Site visit", "Invoice 2231", "Holiday rota", "Contract draft")
AIRPORTS = (("Oslo", "OSL"), ("Lisbon", "LIS"), ("Madrid", "MAD"), ("Munich", "MUC"), ("Dublin", "DUB"),
            ("Athens", "ATH"), ("Vienna", "VIE"), ("Helsinki", "HEL"))
CABINS = (("economy", "economy"), ("premium economy", "premium_economy"), ("business-class", "business"),
          ("first-class", "first"))
STOCKS = (("Apple", "AAPL", "NASDAQ"), ("Coca-Cola", "KO", "NYSE"), ("Unilever", "ULVR", "LSE"),
          ("Siemens", "SIE", "XETRA"), ("Microsoft", "MSFT", "NASDAQ"), ("Nike", "NKE", "NYSE"))
CARRIERS = (("DHL", "dhl"), ("UPS", "ups"), ("FedEx", "fedex"), ("PostNL", "postnl"))


def _day(r: random.Random) -> tuple[str, str]:
    """A date as a request writes it, and ISO."""
    d = date(r.choice((2025, 2026)), r.randint(1, 12), r.randint(1, 28))
    name = MONTHS[d.month - 1]
    return r.choice((f"{d.day} {name} {d.year}", f"{name} {d.day}{ordinal(d.day)}, {d.year}")), d.isoformat()


def _clock(r: random.Random, hours: tuple[int, int]) -> tuple[str, str]:
    """A time of day on the 12-hour clock, and HH:MM."""
    hour, minute = r.randint(*hours), r.choice((0, 15, 30, 45))
    h12, suffix = (hour - 12 if hour > 12 else hour), ("pm" if hour >= 12 else "am")
    return (f"{h12} {suffix}" if minute == 0 else f"{h12}:{minute:02d} {suffix}"), f"{hour:02d}:{minute:02d}"


def _request(r: random.Random, tool: str, phrasing: int) -> tuple[str, dict[str, Any]]:
    """A request for `tool` in one of its two phrasings, and the arguments it states (no more)."""
    if tool in ("get_weather", "get_forecast"):
        city, unit, days = r.choice(WEATHER_CITIES), r.choice(("celsius", "fahrenheit")), r.randint(2, 7)
        if tool == "get_weather":
            return ((f"Is it raining in {city} at the moment?", {"city": city}) if phrasing == 0 else
                    (f"I'm about to step out in {city}. How warm is it right now, in {unit.capitalize()}?",
                     {"city": city, "unit": unit}))
        return ((f"Will I need an umbrella in {city} over the next {days} days?", {"city": city, "days": days})
                if phrasing == 0 else
                (f"Planning a hike near {city}: what will the weather be like for the coming {WORDS[days]} days, "
                 f"in {unit}?", {"city": city, "days": days, "unit": unit}))
    if tool in ("convert_currency", "get_exchange_rate"):
        one, other = r.sample(MONEY, 2)
        if tool == "convert_currency":
            amount = float(r.randint(3, 90) * 10)
            args: dict[str, Any] = {"amount": amount, "from": one, "to": other}
            return ((f"I have {amount:g} {MONEY_WORDS[one]} left over from my trip. How many "
                     f"{MONEY_WORDS[other]} is that?", args) if phrasing == 0 else
                    (f"Work out what {amount:g} {one} comes to in {other}.", args))
        args = {"base": one, "quote": other}
        return ((f"What is today's {one}/{other} exchange rate?", args) if phrasing == 0 else
                (f"Has the rate from {MONEY_WORDS[one]} to {MONEY_WORDS[other]} moved? Just tell me the current "
                 f"exchange rate.", args))
    if tool == "book_table":
        (day, iso), (clock, hhmm) = _day(r), _clock(r, (17, 21))
        place, people = r.choice(RESTAURANTS), r.randint(2, 8)
        args = {"restaurant": place, "people": people, "date": iso, "time": hhmm}
        return ((f"Get us a table for {people} at {place} on {day} at {clock}.", args) if phrasing == 0 else
                (f"Dinner for {WORDS[people]} at {place} on {day}, {clock}: can you sort that out?", args))
    if tool == "cancel_booking":
        booking = f"{random_letters(r, 3)}-{random_digits(r, 4)}"
        return ((f"Something came up, so please drop my reservation {booking}.", {"booking_id": booking})
                if phrasing == 0 else
                (f"I'm ill and won't make it tonight; cancel booking {booking}.",
                 {"booking_id": booking, "reason": "illness"}))
    if tool == "create_reminder":
        (day, iso), (clock, hhmm), text = _day(r), _clock(r, (7, 11)), r.choice(REMINDERS)
        return ((f'Remind me on {day} at {clock} to "{text}".', {"text": text, "date": iso, "time": hhmm})
                if phrasing == 0 else (f'On {day} I need a nudge: "{text}".', {"text": text, "date": iso}))
    if tool == "set_timer":
        minutes = r.randint(4, 25)
        if phrasing == 0:
            return f"Ping me in {minutes} minutes, the pasta will be ready.", {"minutes": minutes}
        span, minutes = r.choice(SPANS_OF_TIME)
        return f"Count down {span} for the roast.", {"minutes": minutes}
    if tool == "send_email":
        (who, address), subject = r.choice(MAILBOXES), r.choice(SUBJECTS)
        args = {"recipient": address, "subject": subject}
        return ((f'Write to {address} with the subject "{subject}" and tell them the report is late.', args)
                if phrasing == 0 else
                (f'Drop {who} a line at {address}, subject "{subject}": the meeting moves to Friday.', args))
    if tool == "search_flights":
        ((from_city, origin), (to_city, destination)), (day, iso) = r.sample(AIRPORTS, 2), _day(r)
        if phrasing == 0:
            return (f"Find flights from {from_city} ({origin}) to {to_city} ({destination}) on {day}.",
                    {"origin": origin, "destination": destination, "date": iso})
        seats, (cabin_text, cabin) = r.randint(2, 4), r.choice(CABINS)
        return (f"Look for {WORDS[seats]} {cabin_text} seats from {origin} to {destination} on {day}.",
                {"origin": origin, "destination": destination, "date": iso, "passengers": seats, "cabin": cabin})
    if tool == "get_stock_price":
        company, symbol, exchange = r.choice(STOCKS)
        return ((f"How are {company} shares ({symbol}) doing right now?", {"symbol": symbol}) if phrasing == 0 else
                (f"Quote me {symbol} on the {exchange}.", {"symbol": symbol, "exchange": exchange}))
    if tool == "track_package":
        number = f"{random_letters(r, 2)}{random_digits(r, 9)}{random_letters(r, 2)}"
        carrier_text, carrier = r.choice(CARRIERS)
        return ((f"Where's my parcel? The {carrier_text} tracking number is {number}.",
                 {"tracking_number": number, "carrier": carrier}) if phrasing == 0 else
                (f"Has {number} been delivered yet?", {"tracking_number": number}))
    raise ValueError(f"no requests for tool {tool!r}")


def tool_choice_many() -> Task:
    r = rng("tool_choice_many")
    names = [t["function"]["name"] for t in MANY_TOOLS]
    items = []
    for i in range(ITEMS):
        # Each tool once, then the first eight (four look-alike pairs) again in their other phrasing.
        tool = names[i % len(names)]
        text, args = _request(r, tool, (i // len(names) + i) % 2)
        items.append(Item(f"tool_choice_many-{i:02d}", text, {"name": tool, "arguments": args}))
    return Task(
        "tool_choice_many", "tool", "tool choice among twelve tools that sound alike (weather now or forecast, "
        "convert or rate, reminder or timer, ...), with dates, times and amounts to normalise", "", "Request", "Call",
        (Field("name", "label"), *(Field(name, compare) for name, compare in ARGUMENTS.items())),
        Item("example", "What's the weather in Oslo right now?",
             {"name": "get_weather", "arguments": {"city": "Oslo"}}),
        tuple(items), tools=MANY_TOOLS,
    )
