// Starts the compare page (templates/runs/compare.html); its data arrives in the "compare-data" json_script.
import { drawComparison } from "../compare.js";

drawComparison(JSON.parse(document.getElementById("compare-data").textContent), document.querySelectorAll(".compare-chart"));
