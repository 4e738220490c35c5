"""Prompts whose answers by SmolLM2-135M-Instruct become its drafter's training data.

Two kinds, both deterministic for a seed and a Python version:
- code: raw continuations cut from the standard library (a `def`/`class` line and up to the next
  5 lines), from `stdlib_corpus.split_files`' training files (held-out files: the val split);
- chat: instructions built from templates and topic lists below, plus "what does this code do"
  and "summarize this docstring" questions cut from the same files, applied through the model's
  chat template by the caller.

Why generated answers and not the corpus itself: a drafter is judged by agreement with the
target, and at serving time the context is the target's own output, so the training contexts
should be too (self-distillation).
"""

from __future__ import annotations

import ast
import random

from gmlx_training import chat_topics
from gmlx_training.stdlib_corpus import corpus_files, read, split_files

CONCEPTS = [
    "recursion", "a hash table", "a linked list", "binary search", "a closure", "a decorator", "a generator",
    "list comprehension", "object-oriented programming", "inheritance", "an API", "a database index", "caching",
    "a race condition", "garbage collection", "unit testing", "version control", "a compiler", "an interpreter",
    "big-O notation", "a stack", "a queue", "dynamic programming", "machine learning", "a neural network",
    "photosynthesis", "gravity", "the water cycle", "inflation", "democracy", "climate change", "the immune system",
    "electricity", "the internet", "encryption", "a black hole", "evolution", "the stock market", "DNA", "a volcano",
]
TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n", "computes the n-th "
    "Fibonacci number", "sorts a list of dictionaries by a key", "counts the words in a text", "removes duplicates "
    "from a list", "merges two sorted lists", "reads a CSV file and returns its rows", "finds the largest element of "
    "a list", "checks whether a string is a palindrome", "converts Celsius to Fahrenheit", "flattens a nested list",
    "returns the greatest common divisor of two numbers", "validates an email address", "counts vowels in a string",
    "implements binary search", "computes the average of a list", "transposes a matrix", "parses a date string",
    "generates all permutations of a list", "checks whether two strings are anagrams", "implements a stack class",
    "returns the n most common words in a text", "converts a decimal number to binary",
]
LANGS = ["Python", "Python", "Python", "JavaScript", "C", "Bash"]
TOPICS = [
    "the ocean", "autumn", "friendship", "a busy city", "mountains", "coffee", "the moon", "a rainy day", "music",
    "learning to code", "a small cat", "the first day of school", "space travel", "a forest", "winter mornings",
]
ACTIVITIES = [
    "staying productive", "learning a new language", "sleeping better", "saving money", "writing clean code",
    "preparing for an interview", "starting to run", "cooking healthy meals", "reducing stress", "studying for exams",
    "giving a presentation", "keeping a plant alive", "traveling on a budget", "debugging a program",
]
QUESTIONS = [
    "What is the capital of {c}?", "Tell me three facts about {c}.", "What language is spoken in {c}?",
    "What is {c} famous for?",
]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Germany", "Kenya", "Mexico", "Australia",
             "Italy", "Norway", "Peru", "Spain", "Vietnam"]


def _templated(rng: random.Random) -> list[str]:
    out = []
    for c in CONCEPTS:
        out.append(rng.choice(["Explain {} in simple terms.", "What is {}?", "Can you explain {} to a beginner?",
                               "Give an example of {}."]).format(c))
    for t in TASKS:
        out.append(f"Write a {rng.choice(LANGS)} function that {t}.")
        out.append(f"How do I write a function that {t}?")
    for t in TOPICS:
        out.append(rng.choice(["Write a short poem about {}.", "Write a short story about {}.",
                               "Describe {} in three sentences."]).format(t))
    for a in ACTIVITIES:
        out.append(rng.choice(["Give me three tips for {}.", "What are some good ways of {}?",
                               "How can I get better at {}?"]).format(a))
    for c in COUNTRIES:
        out.append(rng.choice(QUESTIONS).format(c=c))
    return out


def _snippets(files, rng: random.Random, count: int) -> tuple[list[str], list[str], list[str]]:
    """(code continuations, code-explanation questions, docstring summaries) from `files`."""
    code, explain, docs = [], [], []
    for f in rng.sample(files, min(len(files), count)):
        text = read(f)
        lines = text.splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if starts:
            i = rng.choice(starts)
            code.append("\n".join(lines[i : i + rng.randint(1, 6)])[:400] + "\n")
            j = rng.choice(starts)
            explain.append("What does this code do?\n\n" + "\n".join(lines[j : j + 12])[:600])
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        ds = [d for d in (ast.get_docstring(n) for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Module))) if d and len(d) > 200]
        if ds:
            docs.append("Summarize this in one or two sentences:\n\n" + rng.choice(ds)[:700])
    return code, explain, docs


def build(seed: int = 0, files_per_split: int = 400, general: bool = False) -> dict[str, dict[str, list[str]]]:
    """{"train"|"val": {"code": [raw text], "chat": [user messages]}}; val from held-out files and
    every 10th templated instruction. `general` adds `chat_topics.general`'s ~400 general chat
    prompts to the templated ones, every 10th held out too (off: the prompts of the runs before it
    existed, unchanged; on, the held-out split's snippets differ: the longer chat list's shuffle
    draws more from `rng`)."""
    rng = random.Random(seed)
    train_f, val_f = split_files(corpus_files())
    out = {}
    templ = _templated(rng) + (chat_topics.general(random.Random(seed + 1)) if general else [])
    for split, files in (("train", train_f), ("val", val_f)):
        code, explain, docs = _snippets(files, rng, files_per_split)
        mine = [p for i, p in enumerate(templ) if (i % 10 == 3) == (split == "val")]
        chat = mine + explain + docs
        rng.shuffle(code)
        rng.shuffle(chat)
        out[split] = {"code": code, "chat": chat}
    return out
