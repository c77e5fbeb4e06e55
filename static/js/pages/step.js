// Starts the step page (templates/runs/step.html); its data arrives in the "step-page-config" json_script.
import { drawTimeline } from "../step_page.js";

drawTimeline(document.getElementById("timeline"), JSON.parse(document.getElementById("step-page-config").textContent));
