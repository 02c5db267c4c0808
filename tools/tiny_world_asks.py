"""Asks that need an everyday tool: weather, web search, email, timers, stocks, translation, money,
calendar, clocks, packages, commits, URLs, SQL. Arguments come from what was asked."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from tools import tiny_entities as E
from tools.tiny_phrasing import Ask, either, question, request

_CONDITIONS = ("sunny", "cloudy", "raining", "snowing", "windy", "foggy", "clear")
_SUBJECTS = ("Meeting moved", "Weekly report", "Lunch tomorrow", "Build is green", "Invoice", "Quick update")
_BODIES = ("the meeting moved to 3pm", "the report is ready", "I will be late today", "the release is out",
           "please review my pull request", "thanks for your help", "the server is back up")


def weather(rng: random.Random) -> Ask:
    city, unit = rng.choice(E.CITIES), rng.choice(("", "", "celsius", "fahrenheit"))
    text = either(rng, ("Tell me the current weather for {city}", "Check the weather in {city}",
                        "Get the forecast for {city}", "Look up the weather in {city}"),
                  ("What's the weather in {city}?", "How's the weather in {city} today?", "Is it raining in {city}?",
                   "What is the temperature in {city} right now?", "Do I need an umbrella in {city}?",
                   "How cold is it in {city}?", "Is it warm in {city} today?"), city=city)
    args = {"city": city}
    if unit:
        text, args["unit"] = text.rstrip("?.!") + f" in {unit}" + ("?" if text.endswith("?") else ""), unit
    t, cond = rng.randint(-5, 35), rng.choice(_CONDITIONS)
    result = json.dumps({"temperature": t, "unit": unit or "celsius", "condition": cond})
    return Ask(text, f"It is {t} degrees {unit or 'celsius'} and {cond} in {city}.", "get_weather", args, result)


def search_web(rng: random.Random) -> Ask:
    q = rng.choice(E.TOPICS)
    args: dict = {"query": q}
    if rng.random() < 0.2:
        n = rng.randint(2, 10)
        text, args["max_results"] = request(rng, ("Give me the top {n} results for {q}", "Find {n} pages about {q}"),
                                            n=n, q=q), n
    else:
        text = either(rng, ("Search the web for {q}", "Look up {q} online", "Google {q}",
                            "Find information about {q}", "Search for \"{q}\"", "Find me articles on {q}"),
                      ("What does the internet say about {q}?", "Can you find anything online about {q}?"), q=q)
    result = "\n".join(f"{i}. {q.title()} - www.{rng.choice(E.DOMAINS)}/{i}" for i in (1, 2))
    return Ask(text, f"The top result for {q} is {result.splitlines()[0][3:]}.", "search_web", args, result)


def send_email(rng: random.Random) -> Ask:
    to, subject, body = E.email(rng), rng.choice(_SUBJECTS), rng.choice(_BODIES)
    text = request(rng, ("Send an email to {to} with the subject \"{subject}\" saying {body}",
                         "Email {to}, subject \"{subject}\": {body}",
                         "Write to {to} about \"{subject}\" and tell them {body}",
                         "Mail {to} with subject {subject} and the message \"{body}\""),
                   to=to, subject=subject, body=body)
    return Ask(text, f"I sent the email to {to}.", "send_email", {"to": to, "subject": subject, "body": body},
               "sent")


def set_timer(rng: random.Random) -> Ask:
    n, label = rng.choice((1, 2, 3, 5, 10, 12, 15, 20, 25, 30, 45, 60, 90)), rng.choice(E.TIMER_LABELS)
    if rng.random() < 0.4:
        text = request(rng, ("Remind me in {n} minutes about {label}", "Set a {n} minute timer for {label}",
                             "Start a timer for {label}, {n} minutes"), n=n, label=label)
        args = {"minutes": n, "label": label}
    else:
        text = request(rng, ("Set a timer for {n} minutes", "Start a {n} minute timer", "Timer for {n} min",
                             "Count down {n} minutes", "Wake me up in {n} minutes"), n=n)
        args = {"minutes": n}
    return Ask(text, f"Your {n} minute timer is running.", "set_timer", args, "timer started")


def stock_price(rng: random.Random) -> Ask:
    sym = rng.choice(E.SYMBOLS)
    text = either(rng, ("Get me a quote for {s}", "Check the {s} share price", "Look up the stock price of {s}"),
                  ("What's the price of {s}?", "How much is {s} trading at?", "How is {s} doing today?",
                   "What is {s} stock at right now?"), s=sym)
    price = round(rng.uniform(5, 900), 2)
    return Ask(text, f"{sym} is at {price} dollars.", "get_stock_price", {"symbol": sym},
               json.dumps({"symbol": sym, "price": price}))


def translate(rng: random.Random) -> Ask:
    phrase, lang = rng.choice(E.PHRASES), rng.choice(E.LANGUAGES)
    text = either(rng, ("Translate \"{t}\" into {lang}", "Translate this to {lang}: {t}",
                        "Put \"{t}\" in {lang}"), ("How do you say \"{t}\" in {lang}?", "What is \"{t}\" in {lang}?"),
                  t=phrase, lang=lang)
    return Ask(text, f"In {lang} that is: {phrase} ({lang}).", "translate",
               {"text": phrase, "target_language": lang}, f"{phrase} ({lang})")


def convert_currency(rng: random.Random) -> Ask:
    a, b = rng.sample(E.CURRENCIES, 2)
    amount = rng.choice((rng.randint(1, 5000), round(rng.uniform(1, 999), 2)))
    text = either(rng, ("Convert {x} {a} to {b}", "Change {x} {a} into {b}", "{x} {a} to {b}"),
                  ("How much is {x} {a} in {b}?", "What are {x} {a} worth in {b}?"), x=amount, a=a, b=b)
    out = round(amount * rng.uniform(0.5, 2), 2)
    return Ask(text, f"{amount} {a} is about {out} {b}.", "convert_currency",
               {"amount": amount, "from_currency": a, "to_currency": b}, json.dumps({"amount": out, "currency": b}))


def create_event(rng: random.Random) -> Ask:
    title, day, at = rng.choice(E.EVENTS), E.date(rng), E.clock(rng)
    if rng.random() < 0.5:
        text = request(rng, ("Schedule {t} for {d} at {h}", "Book {t} on {d} at {h}",
                             "Add \"{t}\" to my calendar on {d} at {h}"), t=title, d=day, h=at)
        args = {"title": title, "date": day, "time": at}
    else:
        text = request(rng, ("Add \"{t}\" to my calendar on {d}", "Put {t} in my calendar on {d}",
                             "Create an event called {t} on {d}"), t=title, d=day)
        args = {"title": title, "date": day}
    return Ask(text, f"{title} is in your calendar on {day}.", "create_event", args, "created")


def get_time(rng: random.Random) -> Ask:
    city = rng.choice(E.CITIES)
    text = either(rng, ("Tell me the time in {c}", "Check the local time in {c}"),
                  ("What time is it in {c}?", "What's the local time in {c}?", "Is it night in {c} now?"), c=city)
    at = E.clock(rng)
    return Ask(text, f"It is {at} in {city}.", "get_time", {"city": city}, at)


def install_package(rng: random.Random) -> Ask:
    pkg = rng.choice(E.PACKAGES)
    if rng.random() < 0.3:
        v = f"{rng.randint(0, 5)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}"
        text = request(rng, ("Install {p} version {v}", "pip install {p}=={v}", "Add {p} {v} to the environment"),
                       p=pkg, v=v)
        args = {"package": pkg, "version": v}
    else:
        text = request(rng, ("Install {p}", "pip install {p}", "Add the {p} package", "Set up the {p} library"), p=pkg)
        args = {"package": pkg}
    return Ask(text, f"{pkg} is installed.", "install_package", args, f"Successfully installed {pkg}")


def git_commit(rng: random.Random) -> Ask:
    msg = rng.choice(E.COMMIT_MESSAGES)
    text = request(rng, ("Commit the changes with the message \"{m}\"", "Make a commit: {m}",
                         "Commit everything as \"{m}\"", "Create a commit saying {m}"), m=msg)
    return Ask(text, f"Committed: {msg}.", "git_commit", {"message": msg}, "[main 3f2a1c9] " + msg)


def fetch_url(rng: random.Random) -> Ask:
    url = f"https://{rng.choice(E.DOMAINS)}/{rng.choice(('api/status', 'docs', 'index.html', 'v1/users', 'feed'))}"
    text = either(rng, ("Fetch {u}", "Download {u}", "Get the page at {u}", "Open {u} and tell me what it says"),
                  ("What does {u} return?", "What's on {u}?"), u=url)
    return Ask(text, f"{url} returned a short JSON status.", "fetch_url", {"url": url}, '{"status": "ok"}')


def query_database(rng: random.Random) -> Ask:
    table, n = rng.choice(E.TABLES), rng.randint(2, 20)
    sql, text = rng.choice((
        (f"SELECT COUNT(*) FROM {table}", question(rng, ("How many rows are in the {t} table?",
                                                        "How many {t} do we have in the database?"), t=table)),
        (f"SELECT * FROM {table} LIMIT {n}", request(rng, ("Show me the first {n} {t} in the database",
                                                          "Query the first {n} rows of {t}"), n=n, t=table)),
        (f"SELECT * FROM {table}", request(rng, ("Run the query SELECT * FROM {t}", "Run SELECT * FROM {t}"),
                                           t=table)),
    ))
    return Ask(text, f"The query returned {n} rows.", "query_database", {"query": sql}, f"{n} rows")


GENERATORS: dict[str, Callable[[random.Random], Ask]] = {
    "get_weather": weather, "search_web": search_web, "send_email": send_email, "set_timer": set_timer,
    "get_stock_price": stock_price, "translate": translate, "convert_currency": convert_currency,
    "create_event": create_event, "get_time": get_time, "install_package": install_package,
    "git_commit": git_commit, "fetch_url": fetch_url, "query_database": query_database,
}
