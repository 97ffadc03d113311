"""Views of a run: folds of its log that people look at (read-only; never append).

``trace`` writes Chrome trace-event JSON (Perfetto, chrome://tracing); ``dashboard`` is a
live read-only web page. Both read through ``views.source``; only the CLI imports this
package.
"""
