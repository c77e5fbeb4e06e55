// Starts the run page (templates/runs/detail.html); its data arrives in the "run-page-config" json_script.
import { startRunPage } from "../run_page.js";

startRunPage(JSON.parse(document.getElementById("run-page-config").textContent));
