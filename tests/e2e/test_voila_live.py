"""notebooks/01_quickstart.ipynb as a Voilà dashboard (a real Voilà server and kernel, headless
Chromium): the explorer renders, the notebook's own Python-side selection (the strongest
induction head) shows, and a click on another head makes the kernel recompute that head's
skip-trigram table, which must equal a direct ``pcw.skip_trigrams`` call in this process."""

import pytest
from live_hosts import Voila, wait_for_trigram_rows
from live_lab import REPO

import pycircuits_widgets as pcw

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

def test_quickstart_as_a_voila_dashboard_renders_and_a_click_recomputes(live_page, tmp_path):
    model = pcw.load_pretrained("attn-only-2l")
    layer, head = divmod(int(pcw.head_scores(model)["induction"].argmax()), model.cfg.n_heads)
    target = (0, 0) if (layer, head) != (0, 0) else (0, 1)
    direct = [(t.source_str, t.destination_str, t.out_str)
              for t in pcw.skip_trigrams(model, *target, k=5, approximate=True)]

    page = live_page
    page.set_default_timeout(300_000)  # Voilà runs the whole notebook first (minutes on a loaded 2-core machine)
    with Voila(tmp_path, REPO / "notebooks" / "01_quickstart.ipynb") as voila:
        page.goto(voila.page_url)
        explorer = page.locator(".pcw-explorer")
        label = explorer.locator("[data-testid=selected-head]")
        # the notebook's own cells select the induction head from Python: wait for that
        page.wait_for_function("([el, want]) => el.textContent === want", arg=[label.element_handle(), f"L{layer}.H{head}"])

        explorer.locator(f"section[data-view=attention] button.thumb[data-layer='{target[0]}'][data-head='{target[1]}']").click()
        page.wait_for_function("([el, want]) => el.textContent === want", arg=[label.element_handle(), f"L{target[0]}.H{target[1]}"])
        wait_for_trigram_rows(page, explorer.locator("section[data-view=trigrams]"), direct)
