"""A deterministic generator of GSM8K-style word problems: the offline world's data.

The offline backend runs a tiny character-level model instead of a real LLM. That model has to be
"pretrained" on something that looks like GSM8K (Cobbe et al., 2021), and the offline chapters need
a GSM8K stand-in and a DeepMath-103K (He et al., 2025) stand-in it can attempt. This module writes
both. Every problem is written from templates in this file (no GSM8K or DeepMath text is copied).

Each GSM8K record is ``{"question": str, "answer": str}`` in the format of HF ``openai/gsm8k`` "main":
the answer is a worked solution, one step per line, every step carrying a calculator annotation
``<<a op b=c>>`` followed by ``c``, and a last line ``#### N``. By construction:

* every annotation is arithmetically true and every intermediate value is positive;
* every numeral of the question is used exactly once as an operand, so a question with k numerals
  has exactly k - 1 annotated steps (2 to 6); question numerals are pairwise distinct;
* about 5% of the answers are decimals (money with cents), the rest are integers.

Regenerate the shipped files (byte-identical on every run) from the repository root with::

    python -m trio_helpers.offline.corpus

which writes ``trio_helpers/offline/data/{gsm8k_train,gsm8k_test,deepmath}.jsonl`` and ``manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
GSM8K_SEED = 8_500
DEEPMATH_SEED = 103
COUNTS = {"gsm8k_train": 600, "gsm8k_test": 300, "deepmath": 300}
CENTS_PROBABILITY = 0.055  # share of problems drawn with prices in cents (about 5% decimal answers)
STYLES = ("hash", "sentence", "boxed")
NUMERAL_RE = re.compile(r"\d+(?:\.\d+)?")

# --------------------------------------------------------------------------------------------------
# Numbers and solution chains


class _Reject(Exception):
    """The drawn numbers broke a rule (negative, inexact, repeated numeral...); draw again."""


def fmt(x: Fraction | int) -> str:
    """Write a non-negative terminating number the way GSM8K does: ``12``, ``4.5``, ``0.25``.

    Args:
        x: the value (a Fraction whose decimal expansion terminates, or an int).
    Returns:
        The shortest exact decimal string, without trailing zeros or thousands separators.
    Raises:
        _Reject: if x is negative or has no finite decimal expansion (the generator draws again).

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    x = Fraction(x)
    if x < 0:
        raise _Reject(f"negative value {x}")
    for places in range(7):
        scaled = x * 10**places
        if scaled.denominator == 1:
            digits = str(scaled.numerator).rjust(places + 1, "0")
            return digits if places == 0 else f"{digits[:-places]}.{digits[-places:]}"
    raise _Reject(f"{x} has no short decimal expansion")


def _money(x: Fraction | int) -> str:
    """``$12`` for whole dollars, ``$4.50`` when there are cents."""
    text = fmt(x)
    if "." in text and len(text.split(".")[1]) == 1:
        text += "0"
    return "$" + text


class _Chain:
    """Collects the worked solution: one annotated binary operation per line."""

    def __init__(self, decimals: bool) -> None:
        self.steps: list[str] = []
        self.decimals = decimals
        self.value = Fraction(0)

    def __call__(self, a, op: str, b, text: str, money: bool = False) -> Fraction:
        a, b = Fraction(a), Fraction(b)
        if op == "/" and b == 0:
            raise _Reject("division by zero")
        c = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
        if c <= 1 or (c.denominator != 1 and not self.decimals):  # 1 would read "1 bags"
            raise _Reject(f"unsuitable intermediate value {c}")
        expr = f"{fmt(a)}{op}{fmt(b)}"
        shown = f"{expr} = {'$' if money else ''}<<{expr}={fmt(c)}>>{fmt(c)}"
        self.steps.append(text.replace("@", shown))
        self.value = c
        return c


@dataclass
class _Problem:
    context: list[str]  # declarative sentences holding the numerals
    ask: str  # the GSM8K question sentence
    goal: str  # the same target as a noun phrase, for DeepMath-style phrasings
    chain: _Chain

    @property
    def context_text(self) -> str:
        return " ".join(self.context)


@dataclass(frozen=True)
class _Person:
    name: str
    female: bool

    he = property(lambda s: "she" if s.female else "he")
    him = property(lambda s: "her" if s.female else "him")
    his = property(lambda s: "her" if s.female else "his")
    He = property(lambda s: s.he.capitalize())
    His = property(lambda s: s.his.capitalize())


_NAMES = (
    "Mia:f Liam:m Aisha:f Mateo:m Priya:f Noah:m Sofia:f Kenji:m Chloe:f Omar:m Hannah:f Diego:m "
    "Zara:f Lucas:m Nadia:f Ethan:m Leila:f Samuel:m Grace:f Ravi:m Elena:f Tomas:m Ivy:f Jamal:m "
    "Rosa:f Felix:m Amara:f Owen:m Lucia:f Hiro:m Maya:f Caleb:m Nora:f Andre:m Yuki:f Ben:m "
    "Fatima:f Marcus:m Wen:f Kofi:m Ingrid:f Pablo:m Selma:f Arjun:m Tess:f Victor:m"
).split()
_PEOPLE = tuple(_Person(n.split(":")[0], n.endswith(":f")) for n in _NAMES)


def _people(r: random.Random, k: int = 1) -> list[_Person]:
    return r.sample(_PEOPLE, k)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _price(r: random.Random, lo: int, hi: int, cents: bool) -> Fraction:
    """A whole-dollar price, or with cents when ``cents`` is set."""
    if not cents:
        return Fraction(r.randint(lo, hi))
    return Fraction(r.randint(lo, hi - 1) * 100 + r.choice([25, 50, 75, 20, 40, 99, 45]), 100)


# --------------------------------------------------------------------------------------------------
# Templates: each draws numbers, writes the context, the question and the chain of steps.


_SHOPS = {
    "the stationery store": ["notebooks", "gel pens", "packs of stickers", "folders", "erasers"],
    "the farmers' market": ["jars of honey", "bags of apples", "loaves of bread", "baskets of plums"],
    "the hardware store": ["boxes of nails", "paint brushes", "rolls of tape", "light bulbs"],
    "the toy store": ["toy cars", "jigsaw puzzles", "yo-yos", "kites"],
    "the bakery": ["croissants", "blueberry muffins", "bagels", "slices of cake"],
}


def _shopping(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    store = r.choice(sorted(_SHOPS))
    k = r.choice([1, 2, 2, 3, 3])
    items = r.sample(_SHOPS[store], k)
    qty = [r.randint(2, 9) for _ in items]
    price = [_price(r, 2, 14, cents) for _ in items]
    bought = [f"{q} {it} for {_money(c)} each" for q, it, c in zip(qty, items, price)]
    ctx = [f"{p.name} goes to {store}.", f"{p.He} buys {_join(bought)}."]
    ch = _Chain(cents)
    costs = [ch(q, "*", c, f"The {it} cost @.", money=True) for q, it, c in zip(qty, items, price)]
    total = costs[0]
    for i, c in enumerate(costs[1:], start=1):
        text = f"In total {p.he} spends @." if i == k - 1 else f"The {items[0]} and {items[1]} cost @."
        total = ch(total, "+", c, text, money=True)
    if k == 1 or r.random() < 0.4:
        bill = next((b for b in (20, 50, 100, 200) if b > total), None)
        if bill is None:
            raise _Reject("too expensive")
        ctx.append(f"{p.He} pays with a {_money(bill)} bill.")
        ch(bill, "-", total, f"{p.He} gets @ in change.", money=True)
        return _Problem(ctx, f"How much change does {p.he} get back?",
                        f"the change, in dollars, that {p.name} gets back", ch)
    return _Problem(ctx, f"How much does {p.he} spend in all?",
                    f"the total amount of money, in dollars, that {p.name} spends", ch)


def _wage(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    job = r.choice(["at a bookshop", "as a lifeguard", "at a cafe", "tutoring math", "walking dogs",
                    "at the library", "at a bike shop"])
    wage, hours, days = _price(r, 9, 24, cents), r.randint(3, 8), r.randint(2, 6)
    ctx = [f"{p.name} earns {_money(wage)} per hour {job}.", f"{p.He} works {hours} hours a day for {days} days."]
    ch = _Chain(cents)
    daily = ch(wage, "*", hours, f"{p.He} earns @ each day.", money=True)
    ch(daily, "*", days, f"Over {days} days {p.he} earns @.", money=True)
    ask, goal = f"How much money does {p.he} earn?", f"the amount of money, in dollars, that {p.name} earns"
    if r.random() < 0.5:
        bonus = r.choice([15, 25, 30, 40, 50, 75])
        ctx.append(f"At the end {p.he} also gets a {_money(bonus)} bonus.")
        ch(ch.value, "+", bonus, f"With the bonus {p.he} has @.", money=True)
    if r.random() < 0.5:
        spend = Fraction(r.randint(2, 9) * 10 + r.choice([0, 5]))
        thing = r.choice(["a new jacket", "concert tickets", "books", "a gift"])
        ctx.append(f"{p.He} spends {_money(spend)} on {thing}.")
        ch(ch.value, "-", spend, f"{p.He} has @ left.", money=True)
        ask, goal = f"How much money does {p.he} have left?", f"the amount of money, in dollars, {p.name} has left"
    return _Problem(ctx, ask, goal, ch)


def _reading(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    rate, days, done = r.randint(8, 40), r.randint(3, 20), r.randint(10, 150)
    ch = _Chain(False)
    ctx = [f"{p.name}'s book has {done + rate * days} pages.", f"{p.He} has already read {done} pages."]
    left = ch(done + rate * days, "-", done, f"{p.He} has @ pages left to read.")
    if r.random() < 0.5:
        morning = r.randint(2, rate - 2) if rate > 4 else 2
        ctx.append(f"Each day {p.he} reads {morning} pages in the morning and {rate - morning} pages at night.")
        ch(morning, "+", rate - morning, f"{p.He} reads @ pages a day.")
        ask = f"How many more days will {p.he} need to finish the book?"
        goal = f"the number of days {p.name} still needs to finish the book"
    else:
        ask = f"If {p.he} reads {rate} pages a day, how many more days will {p.he} need to finish the book?"
        goal = f"the number of days {p.name} still needs to finish the book reading {rate} pages a day"
    ch(left, "/", rate, f"It will take {p.him} @ more days.")
    return _Problem(ctx, ask, goal, ch)


def _ages(r: random.Random, cents: bool) -> _Problem:
    a, b = _people(r, 2)
    age, gap, times = r.randint(5, 14), r.randint(2, 9), r.randint(2, 4)
    rel = r.choice(["mother", "father", "aunt", "uncle"])
    sib = "sister" if b.female else "brother"
    older = r.random() < 0.5
    ctx = [f"{a.name} is {age} years old.",
           f"{a.His} {sib} {b.name} is {gap} years {'older' if older else 'younger'} than {a.him}.",
           f"Their {rel} is {times} times as old as {b.name}."]
    ch = _Chain(False)
    ch(age, "+" if older else "-", gap, f"{b.name} is @ years old.")
    if not 22 <= ch.value * times <= 60:
        raise _Reject("implausible parent age")
    ch(ch.value, "*", times, f"Their {rel} is @ years old.")
    if r.random() < 0.6:
        years = r.randint(2, 12)
        ch(ch.value, "+", years, f"In {years} years the {rel} will be @ years old.")
        return _Problem(ctx, f"How old will their {rel} be in {years} years?",
                        f"the age of {a.name}'s {rel} {years} years from now", ch)
    return _Problem(ctx, f"How old is their {rel}?", f"the age of {a.name}'s {rel}", ch)


def _trip(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    verb, lo, hi = r.choice([("drives", 30, 65), ("cycles", 8, 18), ("rides a scooter", 10, 25)])
    s1, s2 = r.sample(range(lo, hi + 1), 2)
    t1, t2 = r.sample(range(2, 6), 2)
    ctx = [f"{p.name} {verb} at {s1} miles per hour for {t1} hours.",
           f"Then {p.he} {'speeds up' if s2 > s1 else 'slows down'} to {s2} miles per hour for {t2} more hours."]
    ch = _Chain(False)
    d1 = ch(s1, "*", t1, f"In the first part {p.he} covers @ miles.")
    d2 = ch(s2, "*", t2, f"In the second part {p.he} covers @ miles.")
    total = ch(d1, "+", d2, f"{p.He} travels @ miles in all.")
    if r.random() < 0.5:
        whole = total + r.randint(5, 90)
        ctx.append(f"The whole trip is {whole} miles long.")
        ch(whole, "-", total, f"{p.He} still has @ miles to go.")
        return _Problem(ctx, f"How many miles does {p.he} still have to go?",
                        f"the number of miles {p.name} still has to travel", ch)
    return _Problem(ctx, f"How many miles does {p.he} travel in all?",
                    f"the total distance, in miles, that {p.name} travels", ch)


_GROUPS = [  # place, members, predicate, per-member extension (sentence, thing)
    ("A school", "students", "ride the bus to school", None),
    ("An orchard", "trees", "are apple trees", ("Each apple tree gives {q} baskets of apples.", "baskets of apples")),
    ("A library", "books", "are novels", None),
    ("A farm", "animals", "are hens", ("Each hen lays {q} eggs a week.", "eggs a week")),
    ("A theater", "seats", "are sold for the first show", None),
    ("A parking lot", "spaces", "are taken", None),
    ("A summer camp", "children", "signed up for swimming", ("Each swimmer gets {q} swim tickets.", "swim tickets")),
    ("A garden", "plants", "are tomato plants", ("Each tomato plant grows {q} tomatoes.", "tomatoes")),
]


def _fractions(r: random.Random, cents: bool) -> _Problem:
    place, members, pred, ext = r.choice(_GROUPS)
    d = r.randint(3, 9)
    n = r.choice([k for k in range(2, d) if _gcd(k, d) == 1] or [0])
    if n == 0:
        raise _Reject("no proper fraction")
    total = d * r.randint(3, 15)
    ctx = [f"{place} has {total} {members}.", f"{n}/{d} of them {pred}."]
    ch = _Chain(False)
    part = ch(total, "/", d, f"Splitting the {members} into {d} equal parts gives @ {members} per part.")
    ch(part, "*", n, f"So @ of the {members} {pred}.")
    if ext and r.random() < 0.6:
        q = r.randint(2, 12)
        ctx.append(ext[0].format(q=q))
        ch(ch.value, "*", q, f"That makes @ {ext[1]}.")
        return _Problem(ctx, f"How many {ext[1]} is that in total?", f"the total number of {ext[1]}", ch)
    return _Problem(ctx, f"How many of the {members} {pred}?", f"the number of {members} that {pred}", ch)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _savings(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    item = r.choice(["bike", "tablet", "pair of skates", "telescope", "guitar", "camera"])
    weekly, weeks, saved = r.randint(5, 30), r.randint(3, 15), r.randint(10, 80)
    gift = r.choice([0, 0, r.randint(10, 60)])
    ch = _Chain(False)
    cost = saved + gift + weekly * weeks
    ctx = [f"{p.name} wants to buy a {item} that costs {_money(cost)}.", f"{p.He} has already saved {_money(saved)}."]
    need = ch(cost, "-", saved, f"{p.He} still needs @.", money=True)
    if gift:
        ctx.append(f"{p.His} grandmother gives {p.him} {_money(gift)} for {p.his} birthday.")
        need = ch(need, "-", gift, f"After the gift {p.he} still needs @.", money=True)
    goal = f"the number of weeks {p.name} needs to save to afford the {item}"
    if r.random() < 0.4:
        spend = r.randint(2, 15)
        ctx.append(f"Each week {p.he} gets {_money(weekly + spend)} of allowance and spends {_money(spend)} of it.")
        ch(weekly + spend, "-", spend, f"{p.He} saves @ each week.", money=True)
        ask = f"How many weeks will it take {p.him} to have enough money?"
    else:
        ask = f"If {p.he} saves {_money(weekly)} each week, how many weeks will it take {p.him} to have enough money?"
        goal += f" at {_money(weekly)} a week"
    ch(need, "/", weekly, f"It will take {p.him} @ weeks.")
    return _Problem(ctx, ask, goal, ch)


def _recipe(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    food = r.choice(["cookies", "pancakes", "muffins", "dumplings", "cupcakes", "tortillas"])
    ingr, lo, hi = r.choice([("cups of flour", 2, 6), ("eggs", 2, 5), ("tablespoons of butter", 3, 9),
                             ("cups of milk", 2, 4), ("teaspoons of vanilla", 2, 3)])
    batch, batches, q = r.randint(8, 30), r.randint(2, 8), r.randint(lo, hi)
    event = r.choice(["a class party", "a picnic", "the school fair", "a birthday party", "a family reunion"])
    ctx = [f"A recipe for {batch} {food} uses {q} {ingr}.",
           f"{p.name} wants to make {batch * batches} {food} for {event}."]
    ch = _Chain(False)
    ch(batch * batches, "/", batch, f"{p.He} has to make @ batches.")
    ch(ch.value, "*", q, f"{p.He} needs @ {ingr}.")
    if r.random() < 0.5:
        if ch.value < 4:
            raise _Reject("too little to split")
        have = r.randint(2, int(ch.value) - 1)
        ctx.append(f"{p.He} already has {have} {ingr} at home.")
        ch(ch.value, "-", have, f"{p.He} needs to buy @ more {ingr}.")
        return _Problem(ctx, f"How many more {ingr} does {p.he} need to buy?",
                        f"the number of {ingr} {p.name} still has to buy", ch)
    return _Problem(ctx, f"How many {ingr} does {p.he} need?", f"the number of {ingr} {p.name} needs", ch)


def _practice(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    act = r.choice(["practices the piano", "practices the violin", "studies Spanish", "does yoga",
                    "practices free throws", "works on a model ship"])
    mins, days, weeks = r.choice([15, 20, 25, 30, 35, 40, 45, 50, 60]), r.randint(3, 5), r.randint(2, 12)
    ctx = [f"{p.name} {act} for {mins} minutes a day, {days} days a week."]
    ch = _Chain(False)
    ch(mins, "*", days, f"{p.He} spends @ minutes a week.")
    if r.random() < 0.5:
        extra = r.choice([30, 40, 45, 60, 75, 90])
        ctx.append(f"On Sundays {p.he} adds one longer session of {extra} minutes.")
        ch(ch.value, "+", extra, f"With the Sunday session that is @ minutes a week.")
    ch(ch.value, "*", weeks, f"In {weeks} weeks that adds up to @ minutes.")
    return _Problem(ctx, f"How many minutes does {p.he} spend on it in {weeks} weeks?",
                    f"the number of minutes {p.name} spends on it in {weeks} weeks", ch)


def _garden(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    plant, produce = r.choice([("pepper plants", "peppers"), ("bean plants", "bean pods"),
                               ("strawberry plants", "strawberries"), ("tomato plants", "tomatoes")])
    rows, per_row, each = r.randint(3, 12), r.randint(4, 15), r.randint(3, 20)
    ctx = [f"{p.name} plants {rows} rows of {plant} with {per_row} plants in each row.",
           f"Each plant produces {each} {produce}."]
    ch = _Chain(False)
    ch(rows, "*", per_row, f"{p.He} has @ plants.")
    ch(ch.value, "*", each, f"They produce @ {produce}.")
    bag_sizes = [b for b in range(4, 13) if ch.value % b == 0]
    if not bag_sizes or r.random() < 0.3:
        return _Problem(ctx, f"How many {produce} does {p.he} harvest?",
                        f"the number of {produce} {p.name} harvests", ch)
    bag = r.choice(bag_sizes)
    ctx.append(f"{p.He} packs the {produce} into bags of {bag}.")
    ch(ch.value, "/", bag, f"{p.He} fills @ bags.")
    if r.random() < 0.5:
        price = r.randint(2, 6)
        ctx.append(f"{p.He} sells each bag for {_money(price)}.")
        ch(ch.value, "*", price, f"{p.He} makes @.", money=True)
        return _Problem(ctx, f"How much money does {p.he} make?", f"the money, in dollars, that {p.name} makes", ch)
    return _Problem(ctx, f"How many bags does {p.he} fill?", f"the number of bags {p.name} fills", ch)


def _tickets(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    event = r.choice(["the zoo", "the science museum", "the aquarium", "the county fair", "the planetarium"])
    adult, child = _price(r, 10, 25, cents), _price(r, 4, 9, cents)
    na, nc = r.randint(2, 4), r.randint(2, 6)
    ctx = [f"Tickets to {event} cost {_money(adult)} for adults and {_money(child)} for children.",
           f"{p.name} buys {na} adult tickets and {nc} children's tickets."]
    ch = _Chain(cents)
    a = ch(na, "*", adult, "The adult tickets cost @.", money=True)
    c = ch(nc, "*", child, "The children's tickets cost @.", money=True)
    total = ch(a, "+", c, "The tickets cost @ in total.", money=True)
    if r.random() < 0.6:
        snack = r.choice(["bottles of water", "bags of popcorn", "pretzels", "ice creams"])
        ns, sp = r.randint(2, 7), _price(r, 2, 5, cents)
        ctx.append(f"{p.He} also buys {ns} {snack} for {_money(sp)} each.")
        s = ch(ns, "*", sp, f"The {snack} cost @.", money=True)
        total = ch(total, "+", s, f"Altogether {p.he} spends @.", money=True)
    if r.random() < 0.4:
        bill = next((b for b in (50, 100, 150, 200, 300) if b > total), None)
        if bill is None:
            raise _Reject("too expensive")
        ctx.append(f"{p.He} pays with {_money(bill)}.")
        ch(bill, "-", total, f"{p.He} gets @ in change.", money=True)
        return _Problem(ctx, f"How much change does {p.he} get?", f"the change, in dollars, {p.name} receives", ch)
    return _Problem(ctx, f"How much does {p.he} spend?", f"the amount, in dollars, that {p.name} spends", ch)


def _bake_sale(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    goods, goods2 = r.sample(["brownies", "cookies", "lemon bars", "cupcakes", "banana muffins", "pies"], 2)
    n, price, cost = r.randint(12, 60), r.randint(2, 6), r.randint(10, 45)
    ctx = [f"{p.name} bakes {n} {goods} for the school bake sale and sells them for {_money(price)} each."]
    ch = _Chain(False)
    count = Fraction(n)
    if r.random() < 0.5:
        left = r.randint(2, 9)
        ctx.append(f"At the end of the day {left} {goods} are left unsold.")
        count = ch(n, "-", left, f"{p.He} sells @ {goods}.")
    income = ch(count, "*", price, f"The {goods} bring in @.", money=True)
    if r.random() < 0.5:
        m, q = r.randint(6, 30), r.randint(3, 9)
        ctx.append(f"{p.He} also sells {m} {goods2} for {_money(q)} each.")
        extra = ch(m, "*", q, f"The {goods2} bring in @.", money=True)
        income = ch(income, "+", extra, f"{p.He} takes in @ altogether.", money=True)
    ctx.append(f"{p.He} spent {_money(cost)} on ingredients.")
    ch(income, "-", cost, f"{p.His} profit is @.", money=True)
    return _Problem(ctx, f"How much profit does {p.he} make?", f"the profit, in dollars, that {p.name} makes", ch)


def _buses(r: random.Random, cents: bool) -> _Problem:
    buses, seats = r.randint(2, 6), r.choice([24, 28, 30, 36, 40, 44, 48, 52])
    people = buses * seats - r.randint(3, 20)
    teachers = r.randint(3, 12)
    place = r.choice(["museum", "zoo", "science center", "state park", "aquarium"])
    ctx = [f"A school takes {people - teachers} students and {teachers} teachers on a trip to the {place}.",
           f"They ride in {buses} buses with {seats} seats each."]
    ch = _Chain(False)
    total = ch(people - teachers, "+", teachers, "There are @ people on the trip.")
    cap = ch(buses, "*", seats, "The buses have @ seats.")
    ch(cap, "-", total, "So @ seats are empty.")
    return _Problem(ctx, "How many seats are empty?", "the number of empty seats on the buses", ch)


def _fuel(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    mpg, gallons = r.randint(18, 40), r.randint(5, 15)
    ctx = [f"{p.name}'s car can travel {mpg * gallons} miles on {gallons} gallons of gas."]
    ch = _Chain(False)
    ch(mpg * gallons, "/", gallons, "The car goes @ miles per gallon.")
    if r.random() < 0.5:
        more = r.choice([g for g in range(3, 21) if g != gallons])
        ch(ch.value, "*", more, f"On {more} gallons it can go @ miles.")
        return _Problem(ctx, f"How far can it travel on {more} gallons?",
                        f"the distance, in miles, the car can travel on {more} gallons", ch)
    trip, price = mpg * r.randint(4, 20), r.randint(3, 6)
    ctx.append(f"Gas costs {_money(price)} per gallon.")
    ch(trip, "/", ch.value, "The trip needs @ gallons.")
    ch(ch.value, "*", price, "The gas costs @.", money=True)
    return _Problem(ctx, f"How much will the gas for a {trip}-mile trip cost?",
                    f"the cost, in dollars, of the gas for a {trip}-mile trip", ch)


_ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"]


def _average(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    n = r.choice([3, 4, 4, 5, 5, 6])
    unit, event, single, lo, hi = r.choice([
        ("points", "basketball games", "game", 4, 30), ("points", "quizzes", "quiz", 60, 99),
        ("pins", "bowling games", "game", 90, 180), ("laps", "swim practices", "practice", 10, 40)])
    xs = r.sample(range(lo, hi + 1), n)
    xs[-1] += (-sum(xs)) % n
    if xs[-1] > hi + n:
        raise _Reject("score out of range")
    ctx = [f"{p.name} had {n} {event} this month.", f"{p.His} results were {_join([str(x) for x in xs])} {unit}."]
    ch = _Chain(False)
    ch(xs[0], "+", xs[1], f"The first two results add up to @ {unit}.")
    for i, x in enumerate(xs[2:], start=2):
        ch(ch.value, "+", x, f"Adding the {_ORDINALS[i]} result gives @ {unit}.")
    ch(ch.value, "/", n, f"{p.His} average is @ {unit}.")
    return _Problem(ctx, f"What is {p.his} average number of {unit} per {single}?",
                    f"the average number of {unit} {p.name} got per {single}", ch)


def _sharing(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    things, pack = r.choice([("stickers", "packs"), ("marbles", "bags"), ("trading cards", "packs"),
                             ("beads", "boxes")])
    friends, each = r.randint(3, 8), r.randint(4, 15)
    packs, per_pack = r.randint(2, 6), r.randint(5, 12)
    keep = r.choice([0, r.randint(3, 12)])
    start = friends * each + keep - packs * per_pack
    if start < 3:
        raise _Reject("nothing to start with")
    ctx = [f"{p.name} has {start} {things}.", f"{p.He} buys {packs} {pack} with {per_pack} {things} in each."]
    ch = _Chain(False)
    ch(packs, "*", per_pack, f"{p.He} buys @ {things}.")
    ch(start, "+", ch.value, f"Now {p.he} has @ {things}.")
    if keep:
        ctx.append(f"{p.He} keeps {keep} for {p.him}self and shares the rest equally among {friends} friends.")
        ch(ch.value, "-", keep, f"{p.He} shares @ {things}.")
    else:
        ctx.append(f"{p.He} shares all of them equally among {friends} friends.")
    ch(ch.value, "/", friends, f"Each friend gets @ {things}.")
    return _Problem(ctx, f"How many {things} does each friend get?", f"the number of {things} each friend receives", ch)


def _tank(r: random.Random, cents: bool) -> _Problem:
    cont = r.choice(["fish tank", "rain barrel", "water trough", "garden pond", "hot tub"])
    rate, leak, minutes = r.randint(6, 30), r.choice([0, r.randint(2, 5)]), r.randint(4, 25)
    have = r.randint(10, 90)
    cap = have + (rate - leak) * minutes
    ctx = [f"A {cont} holds {cap} liters of water and already has {have} liters in it.",
           f"A hose pours in {rate} liters per minute."]
    ch = _Chain(False)
    need = ch(cap, "-", have, f"The {cont} needs @ more liters.")
    net = Fraction(rate)
    if leak:
        ctx.append(f"However, a small leak lets out {leak} liters per minute.")
        net = ch(rate, "-", leak, "The water rises by @ liters each minute.")
    ch(need, "/", net, "It takes @ minutes to fill.")
    return _Problem(ctx, f"How many minutes will it take to fill the {cont}?",
                    f"the number of minutes needed to fill the {cont}", ch)


def _membership(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    club = r.choice(["gym", "climbing club", "swimming club", "chess club", "dance studio"])
    fee, monthly, months = r.choice([20, 25, 30, 40, 50, 60]), r.randint(12, 45), r.randint(2, 12)
    ctx = [f"A {club} charges a {_money(fee)} joining fee and {_money(monthly)} per month."]
    ch = _Chain(False)
    ch(monthly, "*", months, f"The monthly payments come to @.", money=True)
    ch(ch.value, "+", fee, "With the joining fee that is @ per person.", money=True)
    if r.random() < 0.5:
        return _Problem(ctx, f"How much will {p.name} pay for the first {months} months?",
                        f"the amount, in dollars, {p.name} pays for the first {months} months", ch)
    group = r.randint(3, 6)
    ctx.append(f"A group of {group} friends sign up together.")
    ch(ch.value, "*", group, "The group pays @.", money=True)
    if r.random() < 0.5:
        off = r.choice([10, 15, 20, 25, 35])
        ctx.append(f"The {club} takes {_money(off)} off the total for groups.")
        ch(ch.value, "-", off, "After the discount the group pays @.", money=True)
    return _Problem(ctx, f"How much does the group pay for the first {months} months?",
                    f"the total amount, in dollars, the group pays for the first {months} months", ch)


def _painting(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    room = r.choice(["bedroom", "kitchen", "garage", "living room", "studio"])
    w, h, walls, price = r.randint(8, 20), r.randint(7, 10), r.randint(2, 4), r.randint(12, 40)
    area = w * h * (walls if r.random() < 0.5 else 1)
    covers = [c for c in range(20, 121) if area % c == 0 and area // c >= 2]
    if not covers:
        raise _Reject("no can size divides the area")
    cover = r.choice(covers)
    ch = _Chain(False)
    if area == w * h:
        ctx = [f"{p.name} is painting a wall in {p.his} {room} that is {w} feet wide and {h} feet tall."]
        ch(w, "*", h, "The wall has an area of @ square feet.")
    else:
        ctx = [f"{p.name} is painting {walls} walls in {p.his} {room}.",
               f"Each wall is {w} feet wide and {h} feet tall."]
        ch(w, "*", h, "Each wall has an area of @ square feet.")
        ch(ch.value, "*", walls, "The walls have @ square feet in all.")
    ctx.append(f"One can of paint covers {cover} square feet and costs {_money(price)}.")
    ch(ch.value, "/", cover, f"{p.He} needs @ cans of paint.")
    ch(ch.value, "*", price, "The paint costs @.", money=True)
    return _Problem(ctx, "How much will the paint cost?", f"the cost, in dollars, of the paint {p.name} needs", ch)


def _compare(r: random.Random, cents: bool) -> _Problem:
    a, b, c = _people(r, 3)
    things = r.choice(["seashells", "baseball cards", "stamps", "comic books", "postcards"])
    x, times = r.randint(6, 40), r.randint(2, 5)
    fewer = r.randint(3, x * times - 5) if x * times > 8 else 3
    ctx = [f"{a.name} has {x} {things}.",
           f"{b.name} has {times} times as many {things} as {a.name}, "
           f"and {c.name} has {fewer} fewer {things} than {b.name}."]
    ch = _Chain(False)
    ch(x, "*", times, f"{b.name} has @ {things}.")
    ch(ch.value, "-", fewer, f"{c.name} has @ {things}.")
    sizes = [s for s in range(4, 21) if ch.value % s == 0 and ch.value // s >= 2]
    if sizes and r.random() < 0.4:
        size = r.choice(sizes)
        ctx.append(f"{c.name} puts all of them into albums that hold {size} {things} each.")
        ch(ch.value, "/", size, f"{c.name} fills @ albums.")
        return _Problem(ctx, f"How many albums does {c.name} fill?", f"the number of albums {c.name} fills", ch)
    return _Problem(ctx, f"How many {things} does {c.name} have?", f"the number of {things} {c.name} has", ch)


def _split_bill(r: random.Random, cents: bool) -> _Problem:
    k = r.randint(2, 8)
    meal = r.choice(["dinner", "lunch", "pizza", "brunch", "a birthday meal"])
    share = _price(r, 12, 40, cents)
    tip = Fraction(r.choice([8, 10, 12, 15, 18, 20, 24, 30]))
    ch = _Chain(cents)
    ctx = [f"{k} friends go out for {meal}."]
    desserts = Fraction(0)
    if r.random() < 0.5:
        dn, dp = r.randint(2, 6), r.randint(4, 9)
        desserts = Fraction(dn * dp)
        food = share * k - tip - desserts
        ctx += [f"The food costs {_money(food)}, and they also share {dn} desserts that cost {_money(dp)} each."]
        d = ch(dn, "*", dp, "The desserts cost @.", money=True)
        ch(food, "+", d, "The food and desserts cost @.", money=True)
    else:
        food = share * k - tip
        ctx.append(f"The food costs {_money(food)}.")
    if food < 15:
        raise _Reject("meal too cheap")
    ctx.append(f"They leave a {_money(tip)} tip.")
    ch(ch.value if desserts else food, "+", tip, "With the tip the bill is @.", money=True)
    ch(ch.value, "/", k, "Each person pays @.", money=True)
    return _Problem(ctx, "If they split the bill equally, how much does each person pay?",
                    "the amount, in dollars, that each friend pays", ch)


def _party(r: random.Random, cents: bool) -> _Problem:
    guests, pizzas, pp = r.randint(3, 8), r.randint(2, 6), r.randint(9, 16)
    drinks, dp = r.randint(4, 12), r.randint(2, 4)
    occasion = r.choice(["birthday", "graduation", "end-of-season", "farewell", "game night"])
    ctx = [f"{guests} friends are throwing a {occasion} party.",
           f"They order {pizzas} pizzas at {_money(pp)} each and {drinks} bottles of lemonade at {_money(dp)} each."]
    ch = _Chain(False)
    pizza = ch(pizzas, "*", pp, "The pizzas cost @.", money=True)
    coupon = r.choice([0, r.randint(3, 10)])
    if coupon:
        ctx.append(f"A coupon takes {_money(coupon)} off the pizza order.")
        pizza = ch(pizza, "-", coupon, "With the coupon the pizzas cost @.", money=True)
    lemonade = ch(drinks, "*", dp, "The lemonade costs @.", money=True)
    food = ch(pizza, "+", lemonade, "Food and drinks cost @.", money=True)
    deco = -food % guests + guests * r.randint(1, 4)
    ctx.append(f"They also spend {_money(deco)} on decorations.")
    ch(food, "+", deco, "With the decorations the party costs @.", money=True)
    ch(ch.value, "/", guests, "Each friend pays @.", money=True)
    return _Problem(ctx, "If they share the cost equally, how much does each friend pay?",
                    "the amount, in dollars, that each friend pays", ch)


def _factory(r: random.Random, cents: bool) -> _Problem:
    widgets = r.choice(["toy robots", "water bottles", "pencils", "bicycle bells", "phone cases"])
    rate, hours, days = r.randint(20, 90), r.randint(6, 12), r.randint(2, 7)
    bad = r.randint(5, 40)
    ctx = [f"A machine makes {rate} {widgets} per hour and runs for {hours} hours each day.",
           f"Every day, {bad} of the {widgets} it makes fail inspection."]
    ch = _Chain(False)
    ch(rate, "*", hours, f"The machine makes @ {widgets} a day.")
    ch(ch.value, "-", bad, f"Each day @ {widgets} pass inspection.")
    ch(ch.value, "*", days, f"In {days} days @ {widgets} pass.")
    return _Problem(ctx, f"How many {widgets} pass inspection in {days} days?",
                    f"the number of {widgets} that pass inspection in {days} days", ch)


def _running(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    verb, unit, lo, hi = r.choice([("runs", "miles", 2, 8), ("swims", "laps", 10, 40), ("bikes", "kilometers", 8, 30)])
    x, days, y, weeks = r.randint(lo, hi), r.randint(2, 5), r.randint(lo + 2, 3 * hi), r.randint(2, 8)
    ctx = [f"{p.name} {verb} {x} {unit} on each of {days} weekdays and {y} {unit} on Saturday."]
    ch = _Chain(False)
    ch(x, "*", days, f"On weekdays {p.he} covers @ {unit}.")
    ch(ch.value, "+", y, f"Each week {p.he} covers @ {unit}.")
    ch(ch.value, "*", weeks, f"In {weeks} weeks {p.he} covers @ {unit}.")
    return _Problem(ctx, f"How many {unit} does {p.he} cover in {weeks} weeks?",
                    f"the number of {unit} {p.name} covers in {weeks} weeks", ch)


def _supplies(r: random.Random, cents: bool) -> _Problem:
    p = _people(r)[0]
    item = r.choice(["pencils", "markers", "glue sticks", "index cards", "crayons"])
    boxes, per_box, students, each = r.randint(3, 10), r.randint(10, 30), r.randint(12, 30), r.randint(2, 6)
    ctx = [f"{p.name}, a teacher, buys {boxes} boxes of {item} with {per_box} {item} in each box.",
           f"{p.He} gives {each} {item} to each of {p.his} {students} students."]
    ch = _Chain(False)
    have = ch(boxes, "*", per_box, f"{p.He} has @ {item}.")
    given = ch(each, "*", students, f"{p.He} gives away @ {item}.")
    ch(have, "-", given, f"{p.He} has @ {item} left over.")
    return _Problem(ctx, f"How many {item} are left over?", f"the number of {item} left over", ch)


_TEMPLATES: tuple[Callable[[random.Random, bool], _Problem], ...] = (
    _shopping, _wage, _reading, _ages, _trip, _fractions, _savings, _recipe, _practice, _garden,
    _tickets, _bake_sale, _buses, _fuel, _average, _sharing, _tank, _membership, _painting, _compare,
    _split_bill, _party, _factory, _running, _supplies,
)
_CENTS_TEMPLATES = (_shopping, _wage, _tickets, _split_bill)

# --------------------------------------------------------------------------------------------------
# Drawing, checking and rendering problems


def _check(problem: _Problem) -> None:
    """Reject draws that repeat a numeral; raise on template bugs that break the invariants."""
    context = problem.context_text
    question = f"{context} {problem.ask}"
    numerals = [Fraction(x) for x in NUMERAL_RE.findall(question)]
    if len(set(numerals)) != len(numerals):
        raise _Reject("a numeral repeats")
    steps = problem.chain.steps
    if not 2 <= len(steps) <= 6 or len(numerals) != len(steps) + 1:
        raise RuntimeError(f"template bug: {len(numerals)} numerals but {len(steps)} steps in {question!r}")
    if sorted(NUMERAL_RE.findall(problem.ask)) != sorted(NUMERAL_RE.findall(problem.goal)):
        raise RuntimeError(f"template bug: goal and ask disagree on numerals in {question!r}")
    if ". " in problem.ask or not context.endswith("."):
        raise RuntimeError(f"template bug: the question sentence must come last in {question!r}")


def _draw(r: random.Random) -> _Problem:
    cents = r.random() < CENTS_PROBABILITY
    template = r.choice(_CENTS_TEMPLATES if cents else _TEMPLATES)
    for _ in range(200):
        try:
            problem = template(r, cents)
            _check(problem)
            return problem
        except _Reject:
            continue
    raise RuntimeError(f"{template.__name__} kept drawing unusable numbers")


def _context_of(question: str) -> str:
    """Everything before the final question sentence (the part that identifies a problem)."""
    return question.rsplit(". ", 1)[0] + "."


def _draw_unique(n: int, seed: int, exclude: Iterable[str]) -> list[_Problem]:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    r = random.Random(seed)
    seen = {_context_of(q) for q in exclude}
    problems: list[_Problem] = []
    for _ in range(50 * n + 100):
        if len(problems) == n:
            break
        problem = _draw(r)
        if problem.context_text not in seen:
            seen.add(problem.context_text)
            problems.append(problem)
    if len(problems) < n:
        raise RuntimeError(f"could only draw {len(problems)} distinct problems out of {n}")
    return problems


def generate_gsm8k(n: int, seed: int) -> list[dict]:
    """Generate ``n`` distinct GSM8K-format word problems, deterministically from ``seed``.

    Args:
        n: how many problems (>= 0).
        seed: the random seed; the same seed always gives the same records.
    Returns:
        Records ``{"question": str, "answer": str}``; the answer is the worked solution, one annotated
        step per line (``... 3*4 = <<3*4=12>>12 ...``), then ``#### N``.
    Raises:
        ValueError: if n is negative or not an int. TypeError: if seed is not an int.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    records = []
    for problem in _draw_unique(n, seed, exclude=()):
        answer = "\n".join(problem.chain.steps) + f"\n#### {fmt(problem.chain.value)}"
        records.append({"question": f"{problem.context_text} {problem.ask}", "answer": answer})
    return records


_DEEPMATH_FRAMES = ("Determine {goal}.", "Find {goal}.", "Compute {goal}.", "Calculate {goal}.",
                    "What is {goal}?", "Work out {goal}.")


def generate_deepmath(n: int, seed: int, exclude: Iterable[str] = ()) -> list[dict]:
    """Generate a DeepMath-103K-style prompt set from the same problem family, phrased differently.

    Args:
        n: how many prompts (>= 0).
        seed: the random seed.
        exclude: GSM8K questions whose problems must not reappear (matched on everything before
            the final question sentence).
    Returns:
        Records ``{"question": str, "final_answer": str, "difficulty": float, "r1_solution_1": str}``;
        difficulty follows DeepMath's 1-10 scale loosely: 1.5 per solution step minus 0.5, plus 0.5 for a
        decimal answer. ``r1_solution_1`` (named after DeepMath-103K's field) is a worked solution, one annotated
        step per line, ending in ``\\boxed{N}``: the text the offline models are fitted on.
    Raises:
        ValueError: if n is negative or not an int. TypeError: if seed is not an int.

    Introduced in: chapter 06 (notebooks/06_opd).
    """
    r = random.Random(seed + 1)
    records = []
    for problem in _draw_unique(n, seed, exclude):
        ask = r.choice(_DEEPMATH_FRAMES).format(goal=problem.goal)
        final = fmt(problem.chain.value)
        difficulty = 1.5 * len(problem.chain.steps) - 0.5 + (0.5 if "." in final else 0.0)
        solution = "\n".join(problem.chain.steps) + f"\n\\boxed{{{final}}}"
        records.append({"question": f"{problem.context_text} {ask}", "final_answer": final,
                        "difficulty": difficulty, "r1_solution_1": solution})
    return records


def render_solution(record: dict, style: str) -> str:
    """Render a GSM8K record's worked solution with a final-answer line in a chosen style.

    Args:
        record: a ``{"question", "answer"}`` record whose answer ends with a ``#### N`` line.
        style: ``"hash"`` (``#### N``), ``"sentence"`` (``The answer is N.``) or ``"boxed"`` (``\\boxed{N}``).
    Returns:
        The solution lines (without the ``####`` line) followed by the final-answer line.
    Raises:
        ValueError: if style is unknown or the answer has no ``#### N`` line.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    body, sep, final = record["answer"].rpartition("\n#### ")
    if not sep:
        raise ValueError("record['answer'] has no final '#### N' line; pass a GSM8K-format record")
    final = final.strip()
    last = {"hash": f"#### {final}", "sentence": f"The answer is {final}.", "boxed": f"\\boxed{{{final}}}"}[style]
    return f"{body}\n{last}"


# --------------------------------------------------------------------------------------------------
# Shipped files


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(rec, ensure_ascii=True) + "\n" for rec in records).encode("utf-8")


def build_files() -> dict[str, bytes]:
    """Build the bytes of every shipped data file (the two GSM8K splits, DeepMath, the manifest).

    Returns:
        A mapping from file name to content; the same bytes on every call.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    gsm8k = generate_gsm8k(COUNTS["gsm8k_train"] + COUNTS["gsm8k_test"], GSM8K_SEED)
    train, test = gsm8k[: COUNTS["gsm8k_train"]], gsm8k[COUNTS["gsm8k_train"]:]
    deepmath = generate_deepmath(COUNTS["deepmath"], DEEPMATH_SEED, exclude=[g["question"] for g in gsm8k])
    files = {"gsm8k_train.jsonl": _jsonl(train), "gsm8k_test.jsonl": _jsonl(test), "deepmath.jsonl": _jsonl(deepmath)}
    content = hashlib.sha256(b"".join(files[k] for k in sorted(files))).hexdigest()
    manifest = {
        "generator": "python -m trio_helpers.offline.corpus",
        "seeds": {"gsm8k": GSM8K_SEED, "deepmath": DEEPMATH_SEED},
        "files": {name: {"records": data.count(b"\n"), "sha256": hashlib.sha256(data).hexdigest()}
                  for name, data in sorted(files.items())},
        "content_sha256": content,
    }
    files["manifest.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    return files


def write_files(out_dir: Path | str = DATA_DIR) -> dict[str, Path]:
    """Write the shipped data files into ``out_dir`` (default: the package's data folder).

    Returns:
        A mapping from file name to the written path.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, data in build_files().items():
        (out / name).write_bytes(data)
        written[name] = out / name
    return written


def main() -> None:
    """Regenerate the shipped files (``python -m trio_helpers.offline.corpus``), one printed line per file.

    Introduced in: chapter 01 (notebooks/01_gsm8k_data).
    """
    for name, path in write_files().items():
        print(f"wrote trio_helpers/offline/data/{name} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
