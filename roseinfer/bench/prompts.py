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


def chat_prompt_ids(tokenizer, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Token ids of each conversation rendered by the model's chat template, ready to generate."""
    return [
        tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        for messages in conversations
    ]


def user_chats(count: int) -> list[list[dict[str, str]]]:
    """`user_messages(count)`, each as a one-message conversation."""
    return [[{"role": "user", "content": text}] for text in user_messages(count)]


def model_tokenizer(settings: dict):
    """The tokenizer (with chat template) of the model that `settings` (engine arguments) name;
    no weights are loaded."""
    from roseinfer.models.loader import ModelSource

    return ModelSource.resolve(settings.get("model"), settings.get("tokenizer")).tokenizer()
