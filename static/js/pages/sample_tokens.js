// Starts the token view (templates/runs/sample_tokens.html); its data arrives in the "token-view-config" json_script.
import { startTokenView } from "../token_view.js";

startTokenView(JSON.parse(document.getElementById("token-view-config").textContent));
