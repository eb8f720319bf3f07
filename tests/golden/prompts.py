"""Prompts of the golden test: raw and chat-templated, short and long (two of 300+ tokens)."""

LONG_STORY = (
    "The lighthouse keeper on the northern cape had kept the same routine for most of his life. Every evening he "
    "climbed the spiral stairs, polished the great lens with a soft cloth, trimmed the wick and lit the lamp before "
    "the sun touched the sea. He kept a logbook in which he wrote the weather, the ships that passed, and the birds "
    "that rested on the gallery rail. Over the years the entries grew shorter, because the ships grew fewer and the "
    "birds did not change very much. One winter a storm came that was worse than any he remembered. The wind tore "
    "shingles from the roof of the cottage, the rain came sideways through the cracks of the shutters, and the waves "
    "climbed the rocks until spray reached the lantern room itself. Near midnight he saw a light that did not belong "
    "to any star: a small fishing boat, far too close to the reef, its engine failing and its crew shouting words he "
    "could not hear. He had no radio that worked in such weather and no boat of his own. What he had was the lamp, "
    "and a signal lamp he had not used in twenty years, and a memory of the old codes his father had taught him when "
    "he was a boy. He began to flash the way through the gap in the reef, slowly and carefully, long and short, "
    "again and again, until his arms ached and his eyes burned. The boat turned. It crept along the line he gave it, "
    "past the black teeth of the rocks, into the calm water behind the point. In the morning the fishermen climbed "
    "the hill to thank him, and he made them tea, and wrote in the logbook that the night had been eventful."
)

LONG_TECHNICAL = (
    "A paged key-value cache divides the memory that holds attention keys and values into fixed-size blocks, much as "
    "an operating system divides memory into pages. Each request owns a block table that maps its logical token "
    "positions to physical blocks, so a request can grow without reserving its maximum length in advance, and "
    "blocks freed by finished requests can be handed to new ones immediately. Because blocks are small, the memory "
    "wasted by fragmentation is limited to the unfilled tail of the last block of each request. Blocks can also be "
    "shared: when two requests begin with the same system prompt, the blocks that hold that prefix can be referenced "
    "by both, with a reference count that says when a block may be reused. A scheduler that runs on top of such a "
    "cache decides, at every iteration of the model, which requests advance and by how many tokens. Running "
    "requests that are decoding need one new slot each; waiting requests need enough blocks for the part of their "
    "prompt that will be processed in this step. When the cache is full, the scheduler can preempt a running "
    "request, free its blocks, and recompute its state later. The result is that the accelerator stays busy with "
    "many requests at once, which is where most of the throughput of a modern inference server comes from. Explain "
    "in simple words why decoding one token at a time is limited by memory bandwidth rather than arithmetic."
)

GOLDEN_PROMPTS = [
    {"name": "raw_short", "kind": "raw", "text": "The capital of France is"},
    {"name": "raw_code", "kind": "raw", "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"name": "raw_list", "kind": "raw", "text": "Three things every programmer should know:\n1."},
    {"name": "raw_unicode", "kind": "raw", "text": "Café, naïve, jalapeño, 東京 and emoji 🙂 are all"},
    {"name": "raw_long_story", "kind": "raw", "text": LONG_STORY},
    {"name": "chat_short", "kind": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "name": "chat_system",
        "kind": "chat",
        "messages": [
            {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    },
    {
        "name": "chat_multiturn",
        "kind": "chat",
        "messages": [
            {"role": "user", "content": "Give me a name for a grey cat."},
            {"role": "assistant", "content": "How about Smokey?"},
            {"role": "user", "content": "Something more unusual, please."},
        ],
    },
    {"name": "chat_long_technical", "kind": "chat", "messages": [{"role": "user", "content": LONG_TECHNICAL}]},
]

# Extra strings whose token ids the golden file records from transformers (encode only, no generation).
TOKENIZER_STRINGS = [
    "",
    " ",
    "Hello world",
    " Hello world ",
    "hello\n\nworld\t\ttabs",
    "UPPER lower MiXeD",
    "It's, isn't, we'll, they've, I'd, you're.",
    "x = foo(bar, baz=3) + [1, 2, 3]\nreturn {'a': 42}\n",
    "    indented code\n        more indented\n",
    "numbers 12345 and 3.14159 and 1e-9 and 0xFF",
    "Ünïcödé àccents: résumé, façade, São Paulo, Zürich",
    "中文字符和日本語のテキスト、한국어",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "مرحبا بالعالم",
    "<|im_start|>user\nhi<|im_end|>\n",
    "special <|endoftext|> in the middle",
    "trailing spaces   ",
    "\n\n\nleading newlines",
    "a very long word: supercalifragilisticexpialidocious antidisestablishmentarianism",
    "URLs like https://example.com/path?query=value&x=y#frag",
]
