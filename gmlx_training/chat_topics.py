"""General chat prompts (science, nature, health, history, technology, everyday life) for SmolLM2's
drafter data, beside `smollm2_prompts`' templates (`smollm2_data --general`).

Why: the first data runs' chat prompts were mostly about code (what does this code do, summarize
this docstring, write a function) plus ~55 general questions, and the drafter accepted 0.14 of its
drafts on general questions against 0.39 on code (bench_matrix, 20261202T200618Z). These lists widen
the general side. `benchmarks/bench_matrix.py`'s CHAT_ASKS (vaccines, exercise, rainbows, autumn
leaves) are kept out so that benchmark stays held out.
"""

from __future__ import annotations

import random

SUBJECTS = [
    # science and nature
    "the solar system", "the speed of light", "atoms", "molecules", "chemical reactions", "the periodic table",
    "magnetism", "friction", "sound waves", "the greenhouse effect", "ocean tides", "earthquakes", "hurricanes",
    "tornadoes", "glaciers", "coral reefs", "rainforests", "deserts", "the ozone layer", "plate tectonics",
    "the life cycle of a star", "the Big Bang", "the moon's phases", "eclipses", "comets", "the Milky Way",
    "bacteria", "viruses", "cells", "the human heart", "the human brain", "the digestive system", "muscles",
    "bones", "the nervous system", "sleep", "dreams", "memory", "bees", "ants", "whales", "dolphins", "owls",
    "dinosaurs", "fossils", "migration of birds", "hibernation", "food chains", "ecosystems", "biodiversity",
    "renewable energy", "solar panels", "wind turbines", "nuclear power", "batteries", "electric cars",
    "recycling", "pollution", "deforestation", "water purification", "soil", "clouds", "lightning", "snow",
    # history and society
    "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution", "the printing press",
    "the Silk Road", "the Olympic Games", "the invention of the telephone", "the first airplane",
    "the moon landing", "the French Revolution", "the history of writing", "ancient Greece", "castles",
    "the United Nations", "elections", "taxes", "banks", "interest rates", "supply and demand", "trade",
    "money", "credit cards", "insurance", "the job market", "small businesses", "advertising", "marketing",
    # technology
    "smartphones", "the World Wide Web", "email", "search engines", "cloud computing", "artificial intelligence",
    "robots", "3D printing", "GPS", "Wi-Fi", "Bluetooth", "computer memory", "a CPU", "an operating system",
    "passwords", "two-factor authentication", "social media", "video games", "streaming services", "blockchain",
    "self-driving cars", "satellites", "the microwave oven", "refrigerators", "cameras", "television",
    # everyday life and culture
    "healthy eating", "drinking enough water", "meditation", "reading books", "learning a musical instrument",
    "gardening", "baking bread", "making tea", "time management", "public speaking", "teamwork", "leadership",
    "friendship", "kindness", "good habits", "procrastination", "motivation", "creativity", "curiosity",
    "traveling abroad", "learning history", "volunteering", "saving for retirement", "buying a first car",
    "renting an apartment", "moving to a new city", "job interviews", "writing a resume", "remote work",
    "online learning", "chess", "football", "basketball", "yoga", "hiking", "camping", "photography",
    "painting", "poetry", "jazz", "classical music", "movies", "theater", "museums", "libraries", "coffee",
    "chocolate", "pizza", "rice", "spices", "vegetarian diets", "breakfast", "pets", "dogs", "cats", "horses",
]
TEMPLATES = [
    "Explain {} in simple terms.", "Describe how {} works.", "Tell me about {}.", "Give me a brief overview of {}.",
    "What should everyone know about {}?", "Write a short paragraph about {}.", "What is interesting about {}?",
    "How does {} affect our daily lives?", "Explain {} to a ten-year-old.", "What are three facts about {}?",
    "Why is {} important?", "What are the pros and cons of {}?",
]
QUESTIONS = [
    "Why is the sky blue?", "Why do we need sleep?", "How do airplanes stay in the air?", "How does a compass work?",
    "Why is the ocean salty?", "How do plants grow from seeds?", "What makes a good friend?", "How do bees make honey?",
    "Why do cats purr?", "How does the heart pump blood?", "Why do we have seasons?", "How are mountains formed?",
    "What causes thunder?", "How does a refrigerator keep food cold?", "Why do stars twinkle?",
    "How does the internet work?", "What happens when we sleep?", "How do fish breathe underwater?",
    "Why is water important for life?", "How do birds know where to fly in winter?", "What is the tallest mountain?",
    "How can I improve my writing?", "How can I learn to cook?", "What is a good way to start a morning routine?",
    "How do I stay focused while studying?", "How can I make new friends in a new city?", "How do I plan a trip?",
    "What should I pack for a weekend hike?", "How do I take care of a houseplant?", "How can I be more patient?",
    "What is the difference between weather and climate?", "What is the difference between a virus and a bacterium?",
    "What is the difference between a lake and a sea?", "Who invented the light bulb?", "How do batteries store energy?",
    "How does a bicycle stay upright?", "Why does ice float?", "How do volcanoes erupt?", "What is inside the Earth?",
    "How does recycling help the planet?", "How do electric cars work?", "Why do people learn foreign languages?",
    "What makes a story interesting?", "How do you write a good email?", "How can I save energy at home?",
    "What is the best way to learn math?", "How do libraries decide which books to buy?", "Why do we yawn?",
]
ASKS = [  # instructions that are not questions
    "Write a thank-you note to a teacher.", "Write a short birthday message for a friend.",
    "Write a haiku about the sea.", "Write a limerick about a cat.", "Write a short story about a lost key.",
    "Write a short story about a robot who learns to paint.", "Write a product description for a water bottle.",
    "Write a short speech for a graduation.", "Write a polite email asking for a meeting.",
    "Write a short review of a favourite book.", "Write a recipe for a simple salad.",
    "List five ideas for a weekend with family.", "List some tips for a long flight.",
    "Summarize the plot of a fairy tale you know.", "Write a short dialogue between a customer and a waiter.",
    "Write a motivational message for someone starting a new job.", "Describe a sunset over the mountains.",
    "Describe your ideal city.", "Describe a walk through a busy market.", "Give me a packing list for a beach trip.",
]


def general(rng: random.Random) -> list[str]:
    """Each subject through two templates, and every question and instruction once, shuffled."""
    out = [t.format(s) for s in SUBJECTS for t in rng.sample(TEMPLATES, 2)] + QUESTIONS + ASKS
    rng.shuffle(out)
    return out
