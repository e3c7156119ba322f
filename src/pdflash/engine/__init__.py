"""The serving engine: sequences and their lifecycle, verify admission, lanes, outputs, the async engine."""
