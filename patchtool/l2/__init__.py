"""The disk-tier commands, ``patchtool l2 scan`` and ``patchtool l2 restore``.

One entry, :mod:`patchtool.l2.run` (``scan`` and ``restore``), called by
:mod:`patchtool.operations`; the CLI parses the options and renders the
result.  The modules, from the bottom up:

* grammar: :mod:`~patchtool.l2.names` (fs object names and their layout
  namespace), :mod:`~patchtool.l2.redis_keys` (Redis keys, the seal prefix);
* reading a tier: :mod:`~patchtool.l2.tally` (one pass over a directory),
  :mod:`~patchtool.l2.source` (the ``TierSource`` protocol, ``FsTier``),
  :mod:`~patchtool.l2.redis_tier` (``RedisTier``: URL, connection, reads);
* judging it: :mod:`~patchtool.l2.reader` (which names an install reads),
  :mod:`~patchtool.l2.rules` (the categories), :mod:`~patchtool.l2.checksum`
  and :mod:`~patchtool.l2.content_check` (``--verify``),
  :mod:`~patchtool.l2.scan` (one pass, judged);
* moving: :mod:`~patchtool.l2.quarantine`, :mod:`~patchtool.l2.journal`,
  :mod:`~patchtool.l2.restore` (fs), :mod:`~patchtool.l2.redis_move` (Redis);
* one run with its exit status: :mod:`~patchtool.l2.command` (fs),
  :mod:`~patchtool.l2.redis_scan` (Redis);
* people's form: :mod:`~patchtool.l2.render` (``--json`` is the dataclasses,
  :mod:`patchtool.output`).

Nothing is imported here, so ``patchtool status`` never loads a tier module.
"""
