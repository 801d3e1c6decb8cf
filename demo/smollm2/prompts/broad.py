"""The broad part of the head-training prompts (ids `broad-NNNN` in train.jsonl), written for the project.

The first 854 training prompts come from a handful of templates; a head trained on their answers alone agreed with
the target 0.65 of the time on held-out prompts of the same templates but only 0.52 on the benchmark's held-out
prompts. These add breadth: many task shapes (code in 15 languages, concepts, explanations, advice, writing,
comparisons, recipes, history, arithmetic), drawn deterministically. Topics of the held-out benchmark prompts
(perf/prompts/chat.jsonl) and of tune-tree's calibration prompts are excluded (`EXCLUDED`, checked against both files).

    python demo/smollm2/prompts/broad.py          # rewrites the broad-* lines of train.jsonl (idempotent)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
COUNT = 760
SEED = 20261201
SOURCE = "spectree project (templated, broad set: demo/smollm2/prompts/broad.py)"

LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#", "Ruby", "Bash", "Kotlin",
         "Swift", "PHP", "Haskell"]
TASKS = [  # (imperative, noun phrase)
    ("parse a date string in the format YYYY-MM-DD", "parsing a date string"),
    ("check whether an email address looks valid", "validating an email address"),
    ("merge two sorted lists into one sorted list", "merging two sorted lists"),
    ("find the duplicate items in a list", "finding duplicates in a list"),
    ("do a binary search in a sorted array", "binary search"),
    ("flatten a nested list", "flattening a nested list"),
    ("count the vowels in a string", "counting vowels"),
    ("convert a Roman numeral to an integer", "Roman numeral conversion"),
    ("check whether the parentheses in a string are balanced", "balanced parentheses"),
    ("implement a stack with push, pop and peek", "a stack"),
    ("implement a queue using two stacks", "a queue built from two stacks"),
    ("compute the median of a list of numbers", "the median of a list"),
    ("capitalize the first letter of every word in a sentence", "title-casing a sentence"),
    ("generate a random password of a given length", "random password generation"),
    ("compute a factorial without recursion", "an iterative factorial"),
    ("check whether a number is prime", "a primality check"),
    ("rotate an array by k positions", "rotating an array"),
    ("find the longest common prefix of a list of strings", "the longest common prefix"),
    ("implement a least-recently-used cache", "an LRU cache"),
    ("retry a failing operation with exponential backoff", "retries with exponential backoff"),
    ("sort a list of records by one of their fields", "sorting records by a field"),
    ("group a list of items by a key", "grouping items by a key"),
    ("split a list into chunks of size n", "chunking a list"),
    ("compute the distance between two points", "the distance between two points"),
    ("reverse a singly linked list", "reversing a linked list"),
    ("run a breadth-first search on a graph", "breadth-first search"),
    ("run a depth-first search on a graph", "depth-first search"),
    ("memoize an expensive function", "memoization"),
    ("read a text file line by line", "reading a file line by line"),
    ("list every file in a directory tree", "walking a directory tree"),
    ("encode a string with a Caesar cipher", "a Caesar cipher"),
    ("compress a string with run-length encoding", "run-length encoding"),
    ("check whether two words are anagrams", "an anagram check"),
    ("remove duplicate characters from a string", "removing duplicate characters"),
    ("find the second largest number in a list", "the second largest number"),
    ("convert a number to binary", "binary conversion"),
    ("count how many times each character appears in a string", "character counts"),
    ("check whether a string is a valid IPv4 address", "IPv4 address validation"),
    ("compute the greatest element in each row of a matrix", "row maxima of a matrix"),
    ("simulate rolling two dice many times and report the totals", "a dice simulation"),
]
CODE_TEMPLATES = [
    "Write a {lang} function to {task}.",
    "How do I {task} in {lang}?",
    "Show me how to {task} in {lang}, with comments.",
    "What is an idiomatic way to {task} in {lang}?",
    "Write {lang} code to {task} and a small example of calling it.",
    "Explain {noun} and show an implementation in {lang}.",
    "I need to {task} in {lang}. Can you write it and explain the edge cases?",
]
CONCEPTS = ["closures", "generators", "decorators", "async and await", "pointers", "garbage collection",
            "Big-O notation", "hash tables", "dependency injection", "REST APIs", "regular expressions",
            "immutability", "type inference", "exceptions", "virtual environments", "Docker containers",
            "continuous integration", "binary trees", "dynamic programming", "object-oriented programming",
            "functional programming", "unit testing", "version control", "caching", "threads",
            "database indexes", "JSON", "environment variables", "semantic versioning", "code reviews"]
CONCEPT_TEMPLATES = ["Explain {c} to a beginner programmer.", "What are {c} and when should I use them?",
                     "Give me a short overview of {c} with an example.", "What are common mistakes with {c}?"]
PAIRS = [("a list", "a tuple in Python"), ("a process", "a thread"), ("the stack", "the heap"), ("TCP", "UDP"),
         ("GET", "POST requests"), ("an inner join", "a left join"), ("compiled", "interpreted languages"),
         ("git merge", "git rebase"), ("unit tests", "integration tests"), ("an array", "a linked list"),
         ("SQL", "NoSQL databases"), ("let", "const in JavaScript"), ("an interface", "an abstract class"),
         ("concurrency", "parallelism"), ("HTTP", "HTTPS"), ("RAM", "storage"), ("a library", "a framework")]
WHY = ["is the sky blue", "do leaves change color in autumn", "do we have seasons", "does bread rise",
       "do cats purr", "does ice float", "can airplanes fly", "do volcanoes erupt", "do we dream",
       "do stars twinkle", "does iron rust", "do bees make honey", "do rainbows appear after rain",
       "does thunder follow lightning", "do magnets attract iron", "do onions make people cry",
       "is the ocean salty", "do birds migrate", "do we get goosebumps", "does the moon change shape"]
HOW = ["a refrigerator", "a vaccine", "a solar panel", "GPS", "a credit score", "an elevator", "a microwave oven",
       "a search engine", "a 3D printer", "a heat pump", "an electric car battery", "a compass", "the stock market",
       "recycling", "a bicycle gear system", "a thermostat", "a noise-cancelling headphone", "a touch screen",
       "a hydroelectric dam", "the human heart"]
WHAT = ["inflation", "photosynthesis", "democracy", "machine learning", "a black hole", "DNA", "climate change",
        "the placebo effect", "opportunity cost", "supply and demand", "a haiku", "the scientific method",
        "compound interest", "an ecosystem", "gravity", "a metaphor", "the water cycle", "a vaccine trial",
        "renewable energy", "the Renaissance", "a food chain", "plate tectonics", "an election", "a recession"]
WHAT_TEMPLATES = ["What is {x}?", "Explain {x} in simple terms.", "Explain {x} to a twelve-year-old.",
                  "Give me a short explanation of {x} with an everyday example."]
GOALS = ["improve my handwriting", "learn a new language", "save money on groceries", "start running",
         "be more productive when working from home", "prepare for a presentation", "keep houseplants alive",
         "reduce my screen time", "make friends in a new city", "organize my closet", "start a vegetable garden",
         "negotiate a higher salary", "learn to cook", "stay motivated while learning to code",
         "read more books", "take better photos with my phone", "stop procrastinating", "learn to play guitar",
         "write a good resume", "become a better listener"]
GOAL_TEMPLATES = ["How can I {g}?", "Give me five tips to {g}.", "What is a good plan to {g} in a month?"]
SUBJECTS = ["a robot learning to paint", "a lighthouse keeper", "a lost kitten", "a dragon who is afraid of fire",
            "two friends on a road trip", "an old clock", "a small village by the sea", "a time traveler",
            "a talking tree", "the first day at a new school", "a chef who lost their sense of taste",
            "a library at midnight", "a message in a bottle", "a mountain climber", "a rainy afternoon",
            "an astronaut looking at Earth", "a garden in spring", "a fox and a crow", "a forgotten toy",
            "a busy market"]
WRITE_TEMPLATES = ["Write a short story about {s}.", "Write a haiku about {s}.", "Write a limerick about {s}.",
                   "Write a four-line poem about {s}.", "Describe {s} in one vivid paragraph."]
NOTES = ["Write a thank-you note to a neighbor who watered my plants.",
         "Write a short speech for my sister's wedding.",
         "Write a product description for a reusable water bottle.",
         "Write a product description for a pair of noise-cancelling headphones.",
         "Write a friendly reminder message about a team meeting tomorrow.",
         "Write a cover letter opening paragraph for a junior developer job.",
         "Write a short welcome message for new members of a hiking club.",
         "Write an apology message to a friend for missing their birthday party.",
         "Write a LinkedIn post announcing that I finished a data science course.",
         "Write a short review of a cozy coffee shop.",
         "Write a birthday message for my grandmother.",
         "Write instructions for a simple card game for children."]
COMPARE = [("cats", "dogs as pets"), ("tea", "coffee"), ("renting", "buying a home"), ("e-books", "paper books"),
           ("trains", "planes for travel in Europe"), ("Python", "JavaScript for beginners"),
           ("SSDs", "hard drives"), ("running", "swimming for fitness"), ("city life", "country life"),
           ("laptops", "desktop computers"), ("solar", "wind energy"), ("public", "private schools")]
COMPARE_TEMPLATES = ["Compare {a} and {b}.", "What are the pros and cons of {a} versus {b}?"]
LISTS = ["ways to reduce household waste", "healthy breakfast ideas", "board games for families",
         "indoor activities for a rainy day", "ways to stay focused while studying", "easy houseplants",
         "questions to ask when adopting a pet", "habits of successful people", "uses for baking soda",
         "ways to learn vocabulary faster", "classic novels worth reading", "things to pack for a camping trip"]
DISHES = ["pancakes", "guacamole", "fried rice", "lentil curry", "banana bread", "an omelette", "hummus",
          "chicken stir-fry", "vegetable lasagna", "chocolate chip cookies", "a Greek salad", "mashed potatoes"]
PEOPLE = ["Marie Curie", "Leonardo da Vinci", "Nelson Mandela", "Ada Lovelace", "Albert Einstein",
          "Isaac Newton", "Frida Kahlo", "Charles Darwin", "Alan Turing", "Rosa Parks", "Galileo Galilei",
          "Florence Nightingale"]
EVENTS = ["the fall of the Roman Empire", "the French Revolution", "the Industrial Revolution",
          "the first Moon landing", "the invention of the printing press", "the end of the Cold War"]
MATH = ["A shop sells pencils at 3 for $1.20. How much do 10 pencils cost? Explain step by step.",
        "How do I compute a percentage increase? Show an example.",
        "If I save $150 a month, how long until I have $2,000? Explain.",
        "What is the area of a circle with radius 4 cm? Show the steps.",
        "A car travels 180 km in 2 hours and 15 minutes. What is its average speed?",
        "Explain how to add fractions with different denominators, with an example.",
        "What is the probability of rolling two sixes with two dice? Explain.",
        "How many seconds are there in a week? Show the calculation.",
        "Explain what a prime factorization is and factor 360.",
        "Convert 72 degrees of angle to radians and explain the formula."]

# Topics of the held-out benchmark and calibration prompts: no broad prompt may mention them.
EXCLUDED = ["tide", "sourdough", "faint", "kyoto", "blockchain", "telephone", "sleep", "tomato", "planet",
            "budget", "idiom", "nuclear", "interview", "professor", "lantern", "snow", "csv", "pytest",
            "git branch", "off-by-one", "list comprehension", "recursion", "sql query", "debounce",
            "thermometer", "fahrenheit", "http status", "multiplies two matrices", "most frequent words",
            "vegetable garden", "neighbor", "neighbour", "volcan", "yyyy-mm-dd", "moon", "habit", "palindrome",
            "merge two dict"]


def _combos() -> list[str]:
    out = [t.format(lang=lang, task=task, noun=noun) for t in CODE_TEMPLATES for lang in LANGS
           for task, noun in TASKS]
    out += [t.format(c=c) for t in CONCEPT_TEMPLATES for c in CONCEPTS]
    out += [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    out += [f"Why {w}?" for w in WHY] + [f"How does {h} work?" for h in HOW]
    out += [t.format(x=x) for t in WHAT_TEMPLATES for x in WHAT]
    out += [t.format(g=g) for t in GOAL_TEMPLATES for g in GOALS]
    out += [t.format(s=s) for t in WRITE_TEMPLATES for s in SUBJECTS]
    out += NOTES + MATH
    out += [t.format(a=a, b=b) for t in COMPARE_TEMPLATES for a, b in COMPARE]
    out += [f"List five {x}." for x in LISTS] + [f"Give me a simple recipe for {d}." for d in DISHES]
    out += [f"Who was {p} and why are they famous?" for p in PEOPLE]
    out += [f"What caused {e}, in a few paragraphs?" for e in EVENTS]
    return out


# The generated parts of train.jsonl by id prefix, in the order they were written; the templated train-* prompts
# came first. Each generator avoids repeating the prompts written before its part (`earlier_prompts`), never later ones.
PARTS = ("broad-", "wide-", "prose-", "fresh-", "magpie-")


def earlier_prompts(prefix: str) -> set[str]:
    """The prompts of train.jsonl written before the part with this id prefix (train-* and the earlier parts)."""
    later = PARTS[PARTS.index(prefix):]
    return {r["prompt"] for r in map(json.loads, (HERE / "train.jsonl").read_text(encoding="utf-8").splitlines())
            if not r["id"].startswith(later)}


def write_part(prefix: str, source: str, prompts: list[str]) -> int:
    """Rewrite the lines of train.jsonl whose id has this prefix as `prompts` (ids PREFIX0000, ...), where that part
    stands (appended when it is new); returns the file's prompt count."""
    path = HERE / "train.jsonl"
    part = [json.dumps({"id": f"{prefix}{i:04d}", "source": source, "prompt": p, "chat": True})
            for i, p in enumerate(prompts)]
    lines: list[str] = []
    for line in filter(str.strip, path.read_text(encoding="utf-8").splitlines()):
        if not json.loads(line)["id"].startswith(prefix):
            lines.append(line)
        elif part:
            lines += part
            part = []
    path.write_text("\n".join(lines + part) + "\n", encoding="utf-8")
    return len(lines + part)


def held_out_prompts() -> list[str]:
    """The held-out benchmark prompts and tune-tree's calibration prompts (no training prompt may equal one)."""
    return [json.loads(line)["prompt"] for path in (HERE.parents[2] / "perf/prompts/chat.jsonl",
                                                    HERE / "calibration.jsonl")
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def broad_prompts() -> list[str]:
    held_out = held_out_prompts()
    pool = [p for p in dict.fromkeys(_combos()) if not any(w in p.lower() for w in EXCLUDED) and p not in held_out]
    rng = random.Random(SEED)
    # Code prompts are most of the pool (15 languages x 40 tasks x 7 shapes); keep them to about half.
    code = [p for p in pool if any(f" {lang}" in p for lang in LANGS)]
    other = [p for p in pool if p not in set(code)]
    picked = rng.sample(other, min(len(other), COUNT // 2))
    picked += rng.sample(code, COUNT - len(picked))
    rng.shuffle(picked)
    return picked


def main() -> None:
    prompts = broad_prompts()
    print(f"{HERE / 'train.jsonl'}: {write_part('broad-', SOURCE, prompts)} prompts ({len(prompts)} broad)")


if __name__ == "__main__":
    main()
