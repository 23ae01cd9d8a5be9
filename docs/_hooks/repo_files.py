"""MkDocs hook: the pages' links to the repository's own files, outside ``docs/``.

A page links to the files it speaks of where they live (``../idl/aioparamsync.thrift``,
``../examples/train_ctr.py``), so the links work when the pages are read in the
repository. MkDocs sees only ``docs/``: to it such a link leads nowhere. This hook
finds each of them before the pages are built; a link to a file that exists is
given that file, copied into the site under ``src/`` (the same path below it), and
MkDocs rewrites the link to the copy. A link to something that is not a file of
the repository is left alone, and MkDocs's own check reports it (a warning, so a
``--strict`` build fails). A copied file is copied as it is, Markdown included: it
is not a page of the site.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

# A Markdown link's target: ](path) or ](path#anchor); not a URL with a scheme.
LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:)(?P<path>[^)\s#]+)(?:#[^)\s]*)?\)")
# Where the copies go in the site.
COPIES = "src"


class RepositoryFile(File):
    """A file of the repository outside ``docs/``, copied into the site as it is."""

    def is_documentation_page(self) -> bool:
        return False


def on_files(files: Files, config: MkDocsConfig) -> Files:
    docs = Path(config.docs_dir)
    root = docs.parent
    for page in list(files.documentation_pages()):
        text = Path(page.abs_src_path or "").read_text(encoding="utf-8")
        for match in LINK.finditer(text):
            uri = posixpath.normpath(posixpath.join(posixpath.dirname(page.src_uri), match["path"]))
            if not uri.startswith("../") or files.get_file_from_path(uri) is not None:
                continue
            # (normpath, not resolve: a link into a symlinked folder stays in the repository)
            target = Path(os.path.normpath(docs / uri))
            if not target.is_file() or not target.is_relative_to(root):
                continue  # (MkDocs reports the link as leading nowhere)
            inside = target.relative_to(root).as_posix()
            files.append(
                RepositoryFile(
                    uri,
                    str(docs),
                    config.site_dir,
                    config.use_directory_urls,
                    dest_uri=f"{COPIES}/{inside}",
                    # (else its "../" matches the rule that leaves out hidden files)
                    inclusion=InclusionLevel.INCLUDED,
                )
            )
    return files
