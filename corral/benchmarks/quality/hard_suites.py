"""Harder suites, for an instruct model that answers suites.py's unconstrained without a miss: a nested contact
card from a message with distractors, a list of records from a log with corrections, dates and amounts in
varied spellings (one call among twelve tools that sound alike is in many_tools_suite.py). Generated like
suites.py's (seeds.py)."""

from __future__ import annotations

import calendar
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

from corral.benchmarks.quality.seeds import CURRENCIES, ITEMS, MONTHS, ordinal, rng
from corral.benchmarks.quality.tasks import Field, Item, Task, closed_object

ISO_DATE = r"^\d{4}-\d{2}-\d{2}$"
CLOCK = r"^\d{2}:\d{2}$"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
ORDINAL_WORDS = {1: "first", 2: "second", 3: "third", 5: "fifth", 8: "eighth", 9: "ninth", 12: "twelfth"}


def in_words(n: int) -> str:
    """0 <= n < 10,000 in British English words: 2340 -> "two thousand three hundred and forty"."""
    if n < 20:
        return WORDS[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + WORDS[n % 10])
    if n < 1000:
        rest = n % 100
        return f"{WORDS[n // 100]} hundred" + ("" if rest == 0 else f" and {in_words(rest)}")
    rest = n % 1000
    joiner = " and " if 0 < rest < 100 else " "
    return f"{in_words(n // 1000)} thousand" + ("" if rest == 0 else joiner + in_words(rest))


def ordinal_words(n: int) -> str:
    """1 <= n <= 31 as an ordinal in words: 21 -> "twenty-first"."""
    if n in ORDINAL_WORDS:
        return ORDINAL_WORDS[n]
    if n < 20:
        return in_words(n) + "th"
    if n % 10 == 0:
        return TENS[n // 10][:-1] + "ieth"
    return f"{TENS[n // 10]}-{ordinal_words(n % 10)}"


# -- 1. a nested contact card ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Country:
    name: str
    cities: tuple[str, ...]
    streets: tuple[str, ...]  # "{n}" where the house number goes
    postcode: Callable[[random.Random], str]
    line: str  # how the country writes an address line
    code: str  # calling code
    digits: int  # of the national number, without its trunk 0


def random_digits(r: random.Random, n: int) -> str:
    return "".join(str(r.randint(0, 9)) for _ in range(n))


def random_letters(r: random.Random, n: int) -> str:
    return "".join(r.choice("ABCDEFGHJKLMNPRSTUVWXY") for _ in range(n))


EU_LINE = "{street}, {postcode} {city}"
COUNTRIES = (
    Country("Germany", ("Hamburg", "Leipzig", "Cologne"), ("Lange Reihe {n}", "Schillerstraße {n}", "Am Markt {n}"),
            lambda r: random_digits(r, 5), EU_LINE, "+49", 10),
    Country("France", ("Lyon", "Lille", "Nantes"),
            ("{n} rue de la République", "{n} avenue Jean Jaurès", "{n} boulevard Voltaire"),
            lambda r: random_digits(r, 5), EU_LINE, "+33", 9),
    Country("Netherlands", ("Utrecht", "Rotterdam", "Groningen"), ("Oudegracht {n}", "Keizersgracht {n}",
                                                                     "Stationsplein {n}"),
            lambda r: f"{r.randint(1000, 9999)} {random_letters(r, 2)}", EU_LINE, "+31", 9),
    Country("United Kingdom", ("Leeds", "Bristol", "Glasgow"), ("{n} Baker Street", "{n} Queen's Road",
                                                                "{n} Mill Lane"),
            lambda r: f"{random_letters(r, 2)}{r.randint(1, 9)} {r.randint(1, 9)}{random_letters(r, 2)}",
            "{street}, {city} {postcode}", "+44", 10),
    Country("Italy", ("Turin", "Bologna", "Verona"), ("Via Roma {n}", "Corso Vittorio Emanuele {n}",
                                                      "Piazza Cavour {n}"),
            lambda r: random_digits(r, 5), EU_LINE, "+39", 10),
    Country("Spain", ("Valencia", "Seville", "Bilbao"), ("Calle Mayor {n}", "Avenida de la Constitución {n}",
                                                         "Plaza Nueva {n}"),
            lambda r: random_digits(r, 5), EU_LINE, "+34", 9),
    Country("Sweden", ("Uppsala", "Malmö", "Gothenburg"), ("Drottninggatan {n}", "Storgatan {n}", "Kungsgatan {n}"),
            lambda r: f"{r.randint(100, 999)} {r.randint(10, 99)}", EU_LINE, "+46", 9),
    Country("Austria", ("Graz", "Linz", "Salzburg"), ("Herrengasse {n}", "Landstraße {n}", "Getreidegasse {n}"),
            lambda r: str(r.randint(1000, 9999)), EU_LINE, "+43", 10),
    Country("Portugal", ("Porto", "Braga", "Coimbra"), ("Rua de Santa Catarina {n}", "Avenida da Liberdade {n}",
                                                        "Rua Augusta {n}"),
            lambda r: f"{r.randint(1000, 9999)}-{random_digits(r, 3)}", EU_LINE, "+351", 9),
    Country("Norway", ("Bergen", "Trondheim", "Stavanger"), ("Bryggen {n}", "Olav Tryggvasons gate {n}",
                                                             "Kongens gate {n}"),
            lambda r: random_digits(r, 4), EU_LINE, "+47", 8),
)
SENDERS = ("Ingrid Solberg", "Rafael Ortega", "Yuki Tanaka", "Nadia Haddad", "Pieter de Vries", "Grace Mensah",
           "Stefan Novak", "Leila Farouk", "Tom Whitaker", "Ana Costa", "Mikael Lund", "Zara Hussain", "Luca Moretti",
           "Eva Horváth", "Samuel Adeyemi", "Clara Jensen", "Omar Said", "Julia Brandt", "Kofi Asante",
           "Irene Papadakis")
OTHERS = ("Maria Lopez", "David Kim", "Sara Lindqvist", "Ahmed Karimi", "Emma Walsh", "Jan Kowalski", "Nora Berg",
          "Paul Meyer")
COMPANIES = ("Nordlicht Logistics", "Brightwater Analytics", "Castellan Foods", "Helix Robotics", "Marlowe & Finch",
             "Bluefjord Energy", "Oakridge Textiles", "Solstice Media", "Vantage Optics", "Ironbark Consulting")
DEPARTMENTS = ("Procurement", "Customer Success", "Research & Development", "Finance", "Legal", "Human Resources",
               "Logistics", "Marketing")
ELSEWHERE = ("Vienna", "Madrid", "Copenhagen", "Dublin", "Prague", "Brussels", "Zurich", "Helsinki")


def _phone(r: random.Random, country: Country) -> tuple[str, str]:
    """(as the message writes it, E.164): spaced, with the trunk "(0)" that E.164 drops, or dashed."""
    national = str(r.randint(1, 9)) + random_digits(r, country.digits - 1)
    written = r.choice((
        f"{country.code} {national[:2]} {national[2:5]} {national[5:]}",
        f"{country.code} (0){national[:3]} {national[3:]}",
        f"{country.code}-{national[:3]}-{national[3:]}",
    ))
    return written, country.code + national


CARD_TEMPLATES = (
    "Hi {recipient_first},\nthanks for the quick reply. I'm at the trade fair in {elsewhere} until Thursday, so "
    "please send the signed copy to our office below; {other} (cc, {other_phone}) can answer questions while I'm "
    "away.\nKind regards,\n{name}\n{department} | {company}\n{line}, {country}\nPhone: {phone}",
    "{company}, {department}\n{line}\n{country}\nTel. {phone}\nDear {recipient},\nfollowing our meeting in "
    "{elsewhere}, I confirm the order. My colleague {other} will be in touch from our branch in {other_city} "
    "({other_phone}).\nYours sincerely,\n{name}",
    "Please see below, and call me if anything is unclear.\n{name}\n{company}, {department}\n{line}, {country}\n"
    "{phone}\n-----Original message-----\nFrom: {other}, {company} {elsewhere} office, tel. {other_phone}\n"
    "Could you confirm the delivery address?",
    "Dear {recipient},\nplease note that {company} has closed its {elsewhere} office. From 1 May the {department} "
    "team can be reached at {line}, {country}. For urgent matters call me on {phone}, or my assistant {other} on "
    "{other_phone}.\nBest wishes,\n{name}",
)


def contact_card() -> Task:
    r = rng("contact_card")
    senders = list(SENDERS)
    r.shuffle(senders)
    items = []
    for i in range(ITEMS):
        country = COUNTRIES[i % len(COUNTRIES)]
        city, other_city = r.sample(country.cities, 2)
        street, postcode = r.choice(country.streets).format(n=r.randint(2, 180)), country.postcode(r)
        phone, e164 = _phone(r, country)
        other_phone = _phone(r, country)[0]
        recipient, other = r.sample(OTHERS, 2)
        company, department = r.choice(COMPANIES), r.choice(DEPARTMENTS)
        text = CARD_TEMPLATES[i % len(CARD_TEMPLATES)].format(
            recipient=recipient, recipient_first=recipient.split()[0], elsewhere=r.choice(ELSEWHERE), other=other,
            other_phone=other_phone, other_city=other_city, name=senders[i], department=department, company=company,
            line=country.line.format(street=street, postcode=postcode, city=city), country=country.name,
            phone=phone)
        truth = {"name": senders[i], "company": {"name": company, "department": department},
                 "address": {"street": street, "postcode": postcode, "city": city, "country": country.name},
                 "phone": e164}
        items.append(Item(f"contact_card-{i:02d}", text, truth))
    string = {"type": "string"}
    return Task(
        "contact_card", "json", "a nested object: a contact card (company, address) from a message with a "
        "second person and a second city in it",
        "Extract the contact card of the person who signed the message as JSON: their name, their company "
        "(name and department), the address they can be reached at (street, postcode, city, country) and their "
        "phone number in international format (+ and digits only).", "Message", "JSON",
        (Field("name"), Field("company.name"), Field("company.department"), Field("address.street"),
         Field("address.postcode"), Field("address.city"), Field("address.country"), Field("phone", "digits")),
        Item("example", "Hello Anna,\nthe samples left today; my colleague Rob Hale (+1 555 0100) in Boston has the "
             "invoice.\nCheers,\nMarta Silva\nQuality Assurance, Tidewater Ceramics\nRua do Ouro 12, 1100-060 "
             "Lisbon, Portugal\nTel. +351 21 345 6789",
             {"name": "Marta Silva", "company": {"name": "Tidewater Ceramics", "department": "Quality Assurance"},
              "address": {"street": "Rua do Ouro 12", "postcode": "1100-060", "city": "Lisbon",
                          "country": "Portugal"}, "phone": "+351213456789"}),
        tuple(items),
        closed_object({
            "name": string, "company": closed_object({"name": string, "department": string}),
            "address": closed_object({"street": string, "postcode": string, "city": string, "country": string}),
            "phone": {"type": "string", "pattern": r"^\+[1-9][0-9]{6,14}$"}}),
    )


# -- 2. a list of records from a log --------------------------------------------------------------------------
PORTS = ("Rotterdam", "Antwerp", "Gdańsk", "Genoa", "Marseille", "Valencia", "Piraeus", "Gothenburg", "Porto",
         "Dublin", "Tallinn", "Trieste", "Bremen", "Le Havre", "Aarhus", "Riga")
CLERKS = ("Jo", "Sam", "Alex", "Kim", "Robin", "Noor")
FIRST_MENTIONS = (
    "{id} left for {destination} with {crates} crates.",
    "We loaded {crates} crates onto {id}, bound for {destination}.",
    "{id} ({crates} crates) is on its way to {destination}.",
    "The truck for {destination} is {id}; it carries {crates} crates.",
)


def _shipping_log(r: random.Random) -> tuple[str, dict[str, Any]]:
    """A dispatch log and its truth: 3-5 shipments, one of them told in two sentences, one corrected later
    (crates or destination), and sometimes one cancelled, which the answer leaves out."""
    warehouse, *ports = r.sample(PORTS, 8)
    count = r.randint(3, 5)
    prefix = random_letters(r, 2)  # one carrier's ids: alike, as in a real log
    ids = [f"{prefix}-{n}" for n in r.sample(range(100, 1000), count + 1)]
    ships: list[dict[str, Any]] = [{"id": ids[k], "destination": ports[k], "crates": r.randint(2, 40)}
                                   for k in range(count)]
    split, corrected = r.sample(range(count), 2)
    first = [dict(s) for s in ships]  # as the log first tells them
    old: object
    if r.random() < 0.5:  # the crates corrected
        old = first[corrected]["crates"] = next(
            n for n in (ships[corrected]["crates"] + r.choice((-3, -2, 2, 5)), ships[corrected]["crates"] + 4)
            if n >= 2)
        later = r.choice(("Sorry, {id} has {crates} crates, not {old}.",
                          "{id}: I wrote {old} crates above; actually, make that {crates}."))
    else:  # rerouted
        old = first[corrected]["destination"] = ports[count]
        later = "Update: {id} was rerouted from {old} to {destination}."
    mentions = []
    for k in r.sample(range(count), count):
        if k == split:
            mentions.append(f"{ships[k]['id']} is bound for {ships[k]['destination']}.")
        else:
            mentions.append(r.choice(FIRST_MENTIONS).format(**first[k]))
    tail = [later.format(**ships[corrected], old=old),
            f"For the record, {ships[split]['id']} has {ships[split]['crates']} crates on board."]
    if count < 5:  # a number that is no shipment's, where the log has room for it (8-10 sentences in all)
        tail.append(f"Dock {r.randint(1, 9)} was closed for {WORDS[r.randint(2, 5)]} hours in the afternoon.")
    if r.random() < 0.5:
        tail.append(f"{ids[count]} ({r.randint(2, 40)} crates for {ports[count + 1]}) was cancelled and stays here.")
    r.shuffle(tail)
    sentences = [f"Dispatch log, {warehouse} warehouse.", *mentions, *tail, f"Signed off by {r.choice(CLERKS)}."]
    return " ".join(sentences), {"warehouse": warehouse, "shipments": ships}


def records() -> Task:
    r = rng("records")
    items = []
    for i in range(ITEMS):
        text, truth = _shipping_log(r)
        items.append(Item(f"records-{i:02d}", text, truth))
    shipment = closed_object({"id": {"type": "string", "pattern": r"^[A-Z]{2}-[0-9]{3}$"},
                              "destination": {"type": "string"}, "crates": {"type": "integer", "minimum": 1}})
    return Task(
        "records", "json", "a list of records from a longer text: shipments told out of order, corrected later, "
        "one sometimes cancelled",
        "List the shipments that left the warehouse as JSON: the warehouse's city and, for each shipment, its id, "
        "its final destination and its number of crates. A correction later in the log replaces the earlier "
        "value; a cancelled shipment is left out.", "Log", "JSON",
        (Field("warehouse"), Field("shipments", "records", keys=(
            Field("id", "label"), Field("destination"), Field("crates", "number")))),
        Item("example", "Dispatch log, Hull warehouse. ZK-101 left for Oslo with 6 crates. ZK-202 is bound for "
             "Kiel. We loaded 9 crates onto ZK-303, bound for Cádiz. ZK-202 has 4 crates on board. ZK-101: I wrote "
             "6 crates above; actually, make that 7. Signed off by Lee.",
             {"warehouse": "Hull", "shipments": [{"id": "ZK-101", "destination": "Oslo", "crates": 7},
                                                 {"id": "ZK-202", "destination": "Kiel", "crates": 4},
                                                 {"id": "ZK-303", "destination": "Cádiz", "crates": 9}]}),
        tuple(items),
        closed_object({"warehouse": {"type": "string"},
                       "shipments": {"type": "array", "items": shipment, "minItems": 1}}),
    )


# -- 3. dates and amounts to normalise ------------------------------------------------------------------------
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")  # date.weekday() order
NTH = ("first", "second", "third", "fourth")
SPANS = ((1, "the day"), (2, "two days"), (3, "three days"), (7, "a week"), (10, "ten days"), (14, "a fortnight"))
MONEY_NAMES = {"USD": ("dollars", "$", "cents"), "EUR": ("euros", "€", "cents"), "GBP": ("pounds", "£", "pence"),
               "JPY": ("yen", "¥", "")}
AMOUNT_TEMPLATES = (
    "the deposit of {amount} is due {date}.",
    "we wired {amount} to the landlord {date}.",
    "according to the ledger, a refund of {amount} went out {date}.",
    "the supplier's invoice no. {n}, {amount} in total, has to be settled {date}.",
    "the grant of {amount} was approved {date}.",
)


def _date_phrase(r: random.Random, style: int) -> tuple[str, str, date]:
    """(lead, phrase, date): the phrase carries its preposition; a lead gives the year a phrase leaves out."""
    year, month = r.randint(2019, 2026), r.randint(1, 12)
    name = MONTHS[month - 1]
    if style in (0, 1):  # numerals whose order only the note settles: day and month both 12 or less, unequal
        day = r.choice([d for d in range(1, 13) if d != month])
        numerals = f"{day:02d}/{month:02d}/{year} (day first)" if style == 0 else \
            f"{month:02d}/{day:02d}/{year} (US style, month first)"
        return "", f"on {numerals}", date(year, month, day)
    if style == 2:  # relative to a date, often across a month's or a year's end
        anchor = date(year, month, r.randint(20, 28))
        days, words = r.choice(SPANS)
        after = r.random() < 0.6
        return "", f"{words} {'after' if after else 'before'} {anchor.day} {name} {year}", \
            anchor + timedelta(days=days if after else -days)
    if style == 3:  # February's last day in a leap year, the 29th (other months' ends: the relative dates)
        year = r.choice((2020, 2024))
        return "", f"on the last day of February {year}", date(year, 2, calendar.monthrange(year, 2)[1])
    day = r.randint(1, 28)
    if style == 4:  # the year said once, before the date
        return f"in {year}, ", f"on {name} {day}", date(year, month, day)
    if style == 5:
        return "", f"on the {ordinal_words(day)} of {name} {year}", date(year, month, day)
    if style == 6:  # the nth weekday of a month
        weekday, nth = r.randrange(7), r.randint(1, 4)
        first = date(year, month, 1)
        when = first + timedelta(days=(weekday - first.weekday()) % 7 + 7 * (nth - 1))
        return "", f"on the {NTH[nth - 1]} {WEEKDAYS[weekday]} of {name} {year}", when
    return "", f"on {day}{ordinal(day)} {name[:3]}. '{year % 100:02d}", date(year, month, day)


DATE_STYLES = 8


def _amount_phrase(r: random.Random, style: int, currency: str) -> tuple[str, float]:
    """(as the text writes it, its value): words, suffixes, European separators, fractions of a scale."""
    word, sign, cents = MONEY_NAMES[currency]
    if style == 0:
        k = r.randint(11, 19)
        return f"{WORDS[k]} hundred {word}", k * 100.0
    if style == 1:
        v = r.randint(11, 99) / 10
        return f"{sign}{v:g}k", round(v * 1000, 2)
    if style == 2:  # dot for thousands, comma for decimals
        if currency == "JPY":
            v = float(r.randint(10, 999) * 1000)
            return f"¥{v:,.0f}".replace(",", "."), v
        v = r.randint(100000, 9999999) / 100
        return f"{v:,.2f}".translate(str.maketrans(",.", ".,")) + f" {currency}", v
    if style == 3:
        n = r.randint(2, 9)
        scale, size = ("million", 1e6) if currency == "JPY" else ("thousand", 1e3)
        return f"{r.choice((WORDS[n], str(n)))} and a half {scale} {word}", (n + 0.5) * size
    if style == 4:
        v = r.randint(12, 95) / 10
        return f"{sign}{v:g}m", round(v * 1e6, 2)
    if style == 5 and cents:
        n, c = r.randint(2, 99), r.randint(1, 99)
        return f"{in_words(n)} {word} and {in_words(c)} {cents}", n + c / 100
    if style in (5, 6):
        n = r.randint(1100, 9999)
        return f"{in_words(n)} {word}", float(n)
    if style == 7:
        share, words = r.choice(((0.25, "a quarter of a million"), (0.5, "half a million"),
                                 (0.75, "three quarters of a million")))
        return f"{words} {word}", share * 1e6
    n = r.randint(10000, 999999)  # a space for thousands, the code after
    return f"{n:,}".replace(",", " ") + f" {currency}", float(n)


AMOUNT_STYLES = 9


def normalise_hard() -> Task:
    r = rng("normalise_hard")
    items = []
    for i in range(ITEMS):
        lead, phrase, when = _date_phrase(r, i % DATE_STYLES)
        currency = CURRENCIES[i % len(CURRENCIES)]
        amount, value = _amount_phrase(r, (5 * i + 3) % AMOUNT_STYLES, currency)  # every pairing differs
        sentence = lead + AMOUNT_TEMPLATES[i % len(AMOUNT_TEMPLATES)].format(amount=amount, date=phrase,
                                                                           n=r.randint(1000, 9999))
        items.append(Item(f"normalise_hard-{i:02d}", sentence[0].upper() + sentence[1:],
                          {"date": when.isoformat(), "amount": value, "currency": currency}))
    return Task(
        "normalise_hard", "json", "normalisation, harder: relative and ambiguous dates, amounts in words, "
        "suffixes and European separators",
        "Write the date as YYYY-MM-DD (work out relative dates), the amount as a plain number (no symbols, "
        "words or thousands separators) and the currency as its ISO code, as JSON.", "Text", "JSON",
        (Field("date"), Field("amount", "number"), Field("currency", "label")),
        Item("example", "The membership fee, 1.5k dollars, was paid three days after 30 January 2022.",
             {"date": "2022-02-02", "amount": 1500.0, "currency": "USD"}),
        tuple(items),
        closed_object({"date": {"type": "string", "pattern": ISO_DATE}, "amount": {"type": "number"},
                       "currency": {"enum": list(CURRENCIES)}}),
    )
