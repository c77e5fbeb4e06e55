// Starts the runs list page (templates/runs/list.html) from a file, as the Content-Security-Policy requires.
import { followRunsList } from "../runs_list.js";

followRunsList(document.getElementById("runs"));
