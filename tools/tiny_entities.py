"""Things the training asks of glm52-tiny talk about: cities, files, commands, people, topics.

Only training draws from these pools; the fixed evaluation set (tools/tool_use_asks.json) also
names things that are in none of them, so copying the argument out of the ask is what it tests.
"""

from __future__ import annotations

import random

CITIES = (
    "Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Sydney", "Toronto",
    "Chicago", "Boston", "Seattle", "Denver", "Austin", "Miami", "Dublin", "Vienna", "Prague", "Warsaw",
    "Lisbon", "Athens", "Istanbul", "Moscow", "Beijing", "Shanghai", "Seoul", "Mumbai", "Delhi", "Bangkok",
    "Singapore", "Jakarta", "Manila", "Nairobi", "Lagos", "Accra", "Santiago", "Bogota", "Havana", "Quito",
    "Montreal", "Vancouver", "Phoenix", "Atlanta", "Houston", "Dallas", "Portland", "Zurich", "Geneva",
    "Munich", "Hamburg", "Milan", "Naples", "Oslo", "Stockholm", "Helsinki", "Copenhagen", "Brussels",
    "Amsterdam", "Budapest", "Bucharest", "Sofia", "Kyiv", "Dubai", "Doha", "Tehran", "Karachi", "Dhaka",
    "Hanoi", "Osaka", "Kyoto", "Auckland", "Perth", "San Francisco", "New York", "Los Angeles", "Mexico City",
    "Buenos Aires", "Rio de Janeiro", "Cape Town", "Hong Kong", "Kuala Lumpur", "Tel Aviv", "Edinburgh",
)
FIRST_NAMES = (
    "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar",
    "peggy", "rupert", "sybil", "trent", "victor", "walter", "anna", "ben", "chloe", "dan", "emma", "finn",
    "lena", "marco", "nina", "omar", "priya", "raj", "sara", "tom", "uma", "yuki", "zoe", "leo", "maya",
)
DOMAINS = ("example.com", "acme.io", "mail.org", "corp.net", "startup.dev", "uni.edu", "team.co")
SYMBOLS = (
    "AAPL", "MSFT", "GOOG", "AMZN", "TSLA", "NVDA", "META", "IBM", "ORCL", "INTC", "AMD", "NFLX", "UBER",
    "SHOP", "SAP", "SONY", "BABA", "DIS", "KO", "PEP", "NKE", "JPM", "GS", "V", "MA", "CSCO", "QCOM", "ADBE",
)
LANGUAGES = (
    "French", "Spanish", "German", "Italian", "Portuguese", "Japanese", "Chinese", "Korean", "Russian",
    "Dutch", "Swedish", "Polish", "Turkish", "Greek", "Arabic", "Hindi", "Vietnamese",
)
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "SEK", "NOK", "MXN", "BRL", "KRW")
PHRASES = (
    "good morning", "thank you very much", "where is the station", "see you tomorrow", "I love this city",
    "how much does it cost", "the meeting is cancelled", "happy birthday", "please close the door",
    "the code is ready for review", "I am learning to program", "what time is it", "good night",
    "the weather is nice today", "can I have the bill", "welcome to the team", "the build is broken",
)
TOPICS = (
    "python asyncio tutorial", "best practices for REST APIs", "how to use git rebase", "rust borrow checker",
    "latest python release", "docker compose networking", "sqlite vs postgres", "unicode normalization",
    "python packaging guide", "fastapi dependency injection", "kubernetes liveness probe", "regex lookahead",
    "numpy broadcasting rules", "how to profile python code", "TLS certificate renewal", "mars rover news",
    "world cup results", "cheap flights to Lisbon", "vegetarian lasagna recipe", "history of the internet",
    "electric cars range", "how vaccines work", "tips for remote work", "open source licenses explained",
    "pytest fixtures scope", "type hints generics", "linux file permissions", "css grid layout",
)
EVENTS = (
    "Dentist", "Team standup", "Lunch with Sam", "Project review", "Flight to Berlin", "Gym", "Code review",
    "Sprint planning", "Doctor appointment", "Call with the bank", "Birthday party", "Release day",
)
TIMER_LABELS = ("tea", "the oven", "a break", "laundry", "the pasta", "stretching", "the build", "a call")
PACKAGES = (
    "requests", "numpy", "pandas", "flask", "django", "pytest", "rich", "httpx", "pydantic", "sqlalchemy",
    "black", "ruff", "mypy", "scipy", "matplotlib", "click", "typer", "attrs", "pyyaml", "jinja2", "tqdm",
    "boto3", "celery", "redis", "uvicorn", "fastapi", "pillow", "lxml", "beautifulsoup4", "sympy",
)
COMMANDS = (
    "git status", "git log --oneline -5", "ls -la", "pwd", "python --version", "pip list", "make build",
    "make test", "npm install", "npm test", "cargo build", "go test ./...", "df -h", "du -sh .", "whoami",
    "git diff", "git branch", "docker ps", "uname -a", "cat /etc/os-release", "env", "date", "uptime",
    "python -m pip freeze", "tox -e py311", "ruff check .", "mypy src", "black --check .", "git stash",
)
COMMIT_MESSAGES = (
    "fix typo in README", "add retry to the http client", "update dependencies", "refactor config loading",
    "remove dead code", "add tests for the parser", "bump version to 1.2.0", "handle empty input",
)
DIRS = ("", "", "src/", "lib/", "app/", "src/app/", "pkg/", "core/", "server/", "scripts/", "docs/", "utils/")
STEMS = (
    "main", "app", "config", "settings", "utils", "models", "views", "server", "client", "cli", "routes",
    "setup", "manage", "api", "db", "schema", "handlers", "tasks", "helpers", "parser", "README", "notes",
    "requirements", "Makefile", "index", "styles", "Dockerfile", "pyproject", "package", "todo", "CHANGELOG",
)
EXTENSIONS = (".py", ".py", ".py", ".yaml", ".json", ".toml", ".md", ".txt", ".cfg", ".js", ".ts", ".ini")
TABLES = ("users", "orders", "products", "sessions", "events", "invoices", "customers", "logs")


def file_path(rng: random.Random) -> str:
    stem = rng.choice(STEMS)
    ext = "" if stem in ("Makefile", "Dockerfile") else rng.choice(EXTENSIONS)
    return rng.choice(DIRS) + stem + ext


def directory(rng: random.Random) -> str:
    return rng.choice(("src", "lib", "app", "tests", "docs", "scripts", "src/app", "core", "config", "."))


def email(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)}@{rng.choice(DOMAINS)}"


def date(rng: random.Random) -> str:
    return f"20{rng.randint(24, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def clock(rng: random.Random) -> str:
    return f"{rng.randint(7, 20):02d}:{rng.choice(('00', '15', '30', '45'))}"
