"""The saved views that the gallery (scripts/gallery.py) and the JavaScript tests
(js/test/viewFixtures.test.js) render instead of computing two explorers and a sweep: one per
view of the registry, each holding the traits its class syncs now. A view added to the
registry, or a payload that gained or lost a trait, fails here until
``python scripts/gallery.py --save-views`` saves them again."""

import json
import pathlib

import pytest

from pycircuits_widgets.widgets.views.registry import BY_NAME

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "js" / "test" / "fixtures" / "views"
# anywidget adds the widget's id to its state; the layout is a separate model a page never holds
NOT_TRAITS, NOT_SAVED = {"_anywidget_id"}, {"layout"}


def test_every_view_of_the_registry_has_one_saved_view():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(BY_NAME)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_saved_view_holds_the_traits_its_class_syncs(name):
    view, *_ = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["widgets"]
    synced = set(BY_NAME[name].cls.class_trait_names(sync=True)) - NOT_SAVED
    assert set(view["state"]) - NOT_TRAITS == synced
