"""A page of its own on the scheduler's Bokeh dashboard, with the look of Dask's pages.

Dask's dashboard application, its template variables (the navigation) and its theme are not
public API; :mod:`omniload_dask.observe.dashboard` builds the page with these two functions.
"""

from __future__ import annotations

from typing import Any


def add_dashboard_page(
    scheduler: Any, route: str, make_document: Any, nav_name: str | None = None
) -> bool:
    """Serve a Bokeh page at ``route`` on the scheduler's running dashboard; link it in the nav.

    ``make_document(scheduler, extra, doc)`` builds a session's document, as Dask's own pages
    do (``extra`` holds the navigation's template variables). The page gets a Bokeh server
    application of its own, added to the scheduler's HTTP application next to Dask's; it is
    stopped with the scheduler's other HTTP applications. Returns False where the scheduler has
    no Bokeh dashboard (``dashboard_address=None`` or bokeh missing). Idempotent per scheduler.
    """
    try:
        from bokeh.server.server import BokehTornado
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop
    except ImportError:
        return False
    http = getattr(scheduler, "http_application", None)
    apps = [app for app in getattr(http, "applications", ()) if isinstance(app, BokehTornado)]
    if http is None or not apps:
        return False
    if any(route in app.app_paths for app in apps):
        return True
    variables = template_variables(scheduler)  # memoized: the dict Dask's pages render from
    if nav_name and nav_name not in variables["pages"]:
        variables["pages"].append(nav_name)  # the same list object: every page's nav shows it
    prefix = getattr(apps[0], "_prefix", "") or "/"
    app = BokehApplication({route: make_document}, scheduler, prefix, variables)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return True


def style_dashboard_document(doc: Any, extra: dict[str, Any]) -> None:
    """Give ``doc`` the look of Dask's pages: their template (with navigation) and theme."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
