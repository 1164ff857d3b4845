"""The reports of an analysis: the JSON document (document.py) and its renderers: text, HTML, Perfetto."""
