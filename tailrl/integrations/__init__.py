"""Thin adapters from training frameworks to tailrl's public API (``LLM``); optional extras,
imported lazily (``tailrl.integrations.trl`` needs ``pip install 'tailrl[trl]'``)."""
