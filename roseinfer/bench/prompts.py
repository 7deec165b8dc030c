"""A fixed set of chat prompts for benchmarks: varied topics and lengths, deterministic."""

from __future__ import annotations

_TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "the human immune system", "climate change", "the printing press", "quantum computing",
    "honey bees", "the Roman Empire", "plate tectonics", "electric cars", "the water cycle",
    "jazz music", "the Internet", "vaccines", "the Moon landing", "coral reefs", "democracy",
    "blockchain", "the Renaissance", "earthquakes", "solar power", "the Silk Road",
    "DNA", "chess", "the Great Wall of China", "recycling", "rainbows", "the stock market",
    "dinosaurs",
]
_TASKS = [
    "Explain {} to a high-school student.",
    "Write a short story about {}.",
    "What are the main advantages and disadvantages of {}? Answer in a few paragraphs.",
    "Give me five surprising facts about {}, with a sentence of explanation for each.",
]


def user_messages(count: int) -> list[str]:
    """`count` questions, cycling through topic x task combinations."""
    pairs = [(task, topic) for task in _TASKS for topic in _TOPICS]
    return [pairs[i % len(pairs)][0].format(pairs[i % len(pairs)][1]) for i in range(count)]
