"""HumanEval-style Python function headers used to check the bundled code target's greedy continuations.

Written for this repository (not taken from the training data or from HumanEval itself).
"""

PROMPTS: tuple[str, ...] = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_palindrome(text):\n    """Return True if text reads the same forwards and backwards."""\n',
    'def count_vowels(s):\n    """Return the number of vowels in the string s."""\n',
    'def flatten(items):\n    """Flatten a list of lists into a single list."""\n',
    'def parse_key_value(line, sep="="):\n    """Split a "key=value" line and return a (key, value) tuple."""\n',
    'def read_lines(path):\n    """Return the lines of the file at path, without trailing newlines."""\n',
    'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n',
    'class Stack:\n    """A simple last-in, first-out stack."""\n\n    def __init__(self):\n',
    'def merge_dicts(a, b):\n    """Return a new dict with the keys of a and b; values of b win."""\n',
    'def chunked(seq, size):\n    """Yield successive chunks of length size from seq."""\n',
)
